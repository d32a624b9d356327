"""A training loop switched from torch's DataLoader to torchpipe's with one line.

Run: python examples/drop_in.py
"""

from __future__ import annotations

import torch

import torchpipe as tp


class Shapes(torch.utils.data.Dataset):
    """An existing map-style Dataset, unchanged: noisy images of two classes."""

    def __len__(self) -> int:
        return 2048

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        label = i % 2
        image = torch.randn(1, 16, 16) * 0.5
        image[:, 4:12, 4:12] += 1.0 if label else -1.0
        return image, label


def main() -> None:
    device = "cuda" if torch.cuda.is_available() else None
    # Before: loader = torch.utils.data.DataLoader(Shapes(), batch_size=64, shuffle=True, num_workers=2)
    loader = tp.DataLoader(Shapes(), batch_size=64, shuffle=True, num_workers="auto", device=device)

    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(256, 2)).to(device or "cpu")
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(3):
        correct = 0
        for images, labels in loader:  # already on the device when device= is set
            images, labels = images.to(device or "cpu"), labels.to(device or "cpu")
            logits = model(images)
            loss = torch.nn.functional.cross_entropy(logits, labels)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            correct += (logits.argmax(1) == labels).sum().item()
        print(
            f"epoch {epoch}: accuracy {correct / len(loader.dataset):.3f} with {loader.num_workers} workers"
        )


if __name__ == "__main__":
    main()
