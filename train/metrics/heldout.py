"""Sample quality against a held-out split: classifier-FD to the TEST images, class accuracy, and the floor.

Scoring samples against the images the model trained on rewards memorisation and hides overfitting, so a
dataset with a test split is scored against that split. The floor is what real images reach under the same
statistic at the same count: as many TRAIN images as there are samples, scored against the same test
reference. A model cannot be expected to beat it (both sets come from the data distribution; the distance
is the finite-sample bias of a Fréchet distance fitted to that many points).
"""

from __future__ import annotations

import torch

from train.metrics.classifier import SmallCNN, features, sample_scores


class HeldOutReference:
    """Classifier features of `num_real` test images (fixed by `seed`), and the train-vs-test floor."""

    def __init__(self, classifier: SmallCNN, test, train, num_real: int, num_samples: int, seed: int = 0):
        self.classifier = classifier
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(len(test), generator=g)
        self.num_real = min(num_real, len(test))
        real, _ = test.get(order[: self.num_real])
        self.real_features = features(classifier, real)
        picks = torch.randperm(len(train), generator=g)[:num_samples]
        self.floor = self.score(*train.get(picks))

    def score(self, samples: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
        """classifier-FD of `samples` against the test reference, and their accuracy on the requested `labels`."""
        return sample_scores(self.classifier, samples, labels, self.real_features)
