"""AdaFisher in an ordinary PyTorch loop: a drop-in for the authors' code.

Trains a small CNN on real Fashion-MNIST for a bounded number of steps, logs loss and
accuracy to TensorBoard, and prints the test accuracy.  The only AdaFisher-specific
line is the optimizer: ``AdaFisher(model, lr=...)`` binds itself to the model's layers.

    python examples/plain_pytorch.py --max-steps 300 --logdir lightning_logs/plain
"""

from __future__ import annotations

import argparse
import time

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader
from torch.utils.tensorboard import SummaryWriter

from lightning_cafin import AdaFisher, AdaFisherW
from lightning_cafin.data import load_idx_dataset
from lightning_cafin.models import SmallCNN


@torch.no_grad()
def accuracy(model: nn.Module, loader: DataLoader, device: torch.device, max_batches: int | None = None) -> float:
    model.eval()
    correct = total = 0
    for i, (x, y) in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        pred = model(x.to(device)).argmax(1)
        correct += int((pred == y.to(device)).sum())
        total += y.numel()
    model.train()
    return correct / max(total, 1)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data-root", default=None, help="folder with the IDX files (default: look in the usual places)")
    ap.add_argument("--max-steps", type=int, default=300)
    ap.add_argument("--batch-size", type=int, default=128)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--optimizer", choices=["AdaFisher", "AdaFisherW"], default="AdaFisher")
    ap.add_argument("--backend", default="auto")
    ap.add_argument("--eval-batches", type=int, default=None, help="bound the test evaluation (default: all)")
    ap.add_argument("--logdir", default="lightning_logs/plain_pytorch")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    train = DataLoader(load_idx_dataset("fashion-mnist", "train", args.data_root), args.batch_size, shuffle=True, drop_last=True)
    test = DataLoader(load_idx_dataset("fashion-mnist", "test", args.data_root), 1000)
    model = SmallCNN(num_classes=10, in_channels=1).to(device)
    opt_cls = AdaFisher if args.optimizer == "AdaFisher" else AdaFisherW
    opt = opt_cls(model, lr=args.lr, weight_decay=5e-4, backend=args.backend)
    writer = SummaryWriter(args.logdir)
    print(opt.summary(), flush=True)

    step, losses, t0 = 0, [], time.perf_counter()
    while step < args.max_steps:
        for x, y in train:
            x, y = x.to(device), y.to(device)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
            writer.add_scalar("train/loss", losses[-1], step)
            step += 1
            if step % 50 == 0 or step == args.max_steps:
                window = losses[-50:]
                print(f"step {step:5d}/{args.max_steps}  loss {sum(window) / len(window):.4f}  "
                      f"{(time.perf_counter() - t0) / step * 1e3:.0f} ms/step", flush=True)
            if step >= args.max_steps:
                break
    acc = accuracy(model, test, device, args.eval_batches)
    writer.add_scalar("test/accuracy", acc, step)
    writer.close()
    first, last = sum(losses[:20]) / 20, sum(losses[-20:]) / 20
    print(f"test accuracy {acc:.4f}  (loss {first:.3f} -> {last:.3f})")
    print(f"TensorBoard logs: {args.logdir}   open them with: tensorboard --logdir {args.logdir}")
    return {"accuracy": acc, "first_loss": first, "last_loss": last, "steps": step}


if __name__ == "__main__":
    main()
