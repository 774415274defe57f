"""Exercise 1 of lesson 01: what `train_sampler.set_epoch(epoch)` changes in ddp_mnist.py.

Launch (from the repository root):
    torchrun --nproc_per_node=2 01-ddp-basics/solutions/ex1_no_set_epoch.py \\
        --json-out runs/01-ddp-basics/ex1_set_epoch.json
    python 01-ddp-basics/solutions/ex1_no_set_epoch.py --batch-size 64   # one process, global batch 64

ddp_mnist.py calls set_epoch(epoch) on its DistributedSampler before every epoch. This script
trains the lesson's ConvNet twice in one launch, from the same weights, with the lesson's own
loaders, train_epoch and evaluate (loaded from ddp_mnist.py by path): once as the lesson does, and
once with the call removed. It prints, per epoch, the mean loss and the first training images the
sampler gives rank 0, and whether the later epochs repeat epoch 1's order; --json-out adds the
test accuracies (short runs: they move by several images with other CPUs' rounding).
"""

from pathlib import Path

import torch
import torch.distributed as dist

from dtcourse import cli, launch, lessons, report

SCRIPT = "01-ddp-basics/solutions/ex1_no_set_epoch.py"
LESSON = Path(__file__).resolve().parents[1]



mnist = lessons.load(LESSON / "ddp_mnist.py")


def train(args, d, train_set, test_set, set_epoch: bool) -> dict:
    """ddp_mnist.train's loop, with or without set_epoch; the order, losses and accuracies."""
    sampler, train_loader, test_loader = mnist.make_loaders(args, d, train_set, test_set)
    torch.manual_seed(args.seed)
    model = mnist.DDP(mnist.ConvNet().to(d.device),
                      device_ids=[d.device.index] if d.device.type == "cuda" else None)
    optimizer = torch.optim.Adam(model.parameters(), lr=args.lr)
    out = {"orders": [], "losses": [], "accuracies": []}
    for epoch in range(args.epochs):
        if set_epoch:
            sampler.set_epoch(epoch)  # the line the exercise removes
        out["orders"].append(list(iter(sampler)))  # this rank's images, in the order they come
        losses = mnist.train_epoch(model, optimizer, train_loader, d.device, f"epoch {epoch + 1}")
        dist.all_reduce(losses)
        out["losses"].append((losses.mean() / d.world_size).item())
        out["accuracies"].append(mnist.evaluate(model, test_loader, d.device))
    return out


def run(args, d) -> None:
    train_set, test_set = mnist.load_data(args)
    report.print0(f"world {d.world_size} | device {d.device} | {len(train_set)} training images, "
                  f"{len(test_set)} test | batch {args.batch_size} per rank, "
                  f"{args.batch_size * d.world_size} global")
    runs = {"with set_epoch": train(args, d, train_set, test_set, True),
            "without set_epoch": train(args, d, train_set, test_set, False)}
    for name, r in runs.items():
        report.print0(f"{name}:")
        for e in range(args.epochs):
            report.print0(f"  epoch {e + 1} | loss {r['losses'][e]:.4f} | rank 0's first images "
                          f"{', '.join(str(i) for i in r['orders'][e][:6])}, ...")
        same = all(o == r["orders"][0] for o in r["orders"][1:])
        report.print0(f"  every epoch in epoch 1's order on rank 0: {'yes' if same else 'no'}")
    orders = report.gather({name: r["orders"] for name, r in runs.items()})
    if args.json_out and d.rank == 0:
        report.write_json(args.json_out, {
            "script": SCRIPT, "world_size": d.world_size, "batch_size": args.batch_size,
            "seed": args.seed, "train_size": len(train_set), "epochs": args.epochs,
            "runs": {name: {"losses": r["losses"], "accuracies": r["accuracies"],
                            "orders_per_rank": [o[name] for o in orders]}
                     for name, r in runs.items()}})
    dist.barrier()  # the file is complete before any rank exits


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_output_args(p, metrics=False, export=False, json_out=True)
    p.add_argument("--epochs", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=32, help="images per rank per step")
    p.add_argument("--lr", type=float, default=2e-3, help="Adam learning rate")
    p.add_argument("--train-size", type=int, default=1024, help="synthetic training images")
    p.add_argument("--test-size", type=int, default=1024, help="synthetic test images")
    args = p.parse_args(argv)
    args.dataset = "synthetic"
    cli.check_positive(args, "epochs", "batch_size", "train_size", "test_size", "lr",
                       "timeout_s")
    return args


def main(argv=None):
    args = parse_args(argv)
    with launch.distributed(args.device, args.timeout_s) as d:
        run(args, d)


if __name__ == "__main__":
    main()
