"""Evaluation metrics: feature networks (Inception, a small classifier), the Fréchet distance, and FID."""
