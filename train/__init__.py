"""The training core (trainer, config -> objects, checkpoints, logging) and its thin commands; wings data/, metrics/, bench/."""
