"""Lesson 05d: the DDP template's training (01-ddp-basics/ddp_training.py) in TensorFlow, with
tf.distribute: the same MLP, the same initial weights, the same batches, the same AdamW.

Launch (from the repository root):
    python 05-advanced/d-other-frameworks/tf_train.py --strategy one          # one device
    python 05-advanced/d-other-frameworks/tf_train.py --strategy mirrored --replicas 2
    python 05-advanced/d-other-frameworks/tf_train.py --strategy multiworker --spawn 2
    # one worker per machine: each is told the cluster and its own index by TF_CONFIG
    TF_CONFIG='{"cluster": {"worker": ["node0:12345", "node1:12345"]},
                "task": {"type": "worker", "index": 0}}' \\
        python 05-advanced/d-other-frameworks/tf_train.py --strategy multiworker
    TF_USE_LEGACY_KERAS=1 python ... --strategy multiworker --spawn 2 --loop fit   # Keras 2

The strategies:
    one          OneDeviceStrategy: no distribution; the reference, like `python ddp_training.py`.
    mirrored     MirroredStrategy: ONE process drives several devices (GPUs, or on a CPU logical
                 devices split from it, --replicas), a replica of the model on each; gradients are
                 summed across them in-process.
    multiworker  MultiWorkerMirroredStrategy: several processes ("workers"), usually one per
                 machine mirroring over its GPUs (one per GPU also works); they find each
                 other through TF_CONFIG and all-reduce with collective ops (ring on CPU,
                 NCCL on GPUs).

What DDP does, and where TensorFlow does it:
    torch.manual_seed + MLP()    -> the torch MLP's initial weights copied in, transposed
    DDP(model)                   -> build the model and optimizer inside strategy.scope(): their
                                    variables become mirrored, one equal copy per replica
    rank r's rows r*B..(r+1)*B-1 -> experimental_distribute_values_from_function (custom loop);
                                    model.fit splits each global batch itself
    loss.mean(); backward        -> per-sample losses summed / GLOBAL batch (compute_average_loss)
    DDP's all-reduce (average)   -> optimizer.apply_gradients all-reduces (SUM) across replicas:
                                    the sum of per-replica "sum / global batch" is the mean
    optimizer.step()             -> the same update on every replica: weights stay equal

TensorFlow is imported after torch and only once the arguments are checked: it takes seconds to
import, and in one process torch's compiler stack (triton) crashes when it loads after TensorFlow,
so this script uses torch only for the initial weights, the data and the export.
"""

import json
import os
import socket
import signal
import subprocess
import sys
import time
from types import SimpleNamespace

import torch

from dtcourse import cli, report
from dtcourse.data import classification_batch
from dtcourse.models import MLP

SCRIPT = "05-advanced/d-other-frameworks/tf_train.py"
STRATEGY_NAMES = {"one": "OneDeviceStrategy", "mirrored": "MirroredStrategy",
                  "multiworker": "MultiWorkerMirroredStrategy"}
STRATEGIES = tuple(STRATEGY_NAMES)
LINEARS = ("net.0", "net.2", "net.4")  # the torch MLP's Linear layers (GELUs between them)


# --------------------------------------------------------------------------------------------------
# The same model, weights and optimizer as the torch template


def torch_initial_weights(args) -> dict[str, torch.Tensor]:
    """The template's initial weights: torch's default init after torch.manual_seed(seed)."""
    torch.manual_seed(args.seed)
    return MLP(args.hidden).state_dict()


def build_model(tf, args, init: dict):
    """Dense(hidden, gelu) x 2 -> Dense(10): torch's Linear computes x @ W.T + b with W (out, in);
    Keras's Dense computes x @ K + b with K (in, out), so K = W.T."""
    keras = tf.keras
    gelu = lambda t: tf.nn.gelu(t, approximate=False)  # noqa: E731 - torch's nn.GELU(): erf form
    model = keras.Sequential([keras.Input((32,)),
                              keras.layers.Dense(args.hidden, activation=gelu),
                              keras.layers.Dense(args.hidden, activation=gelu),
                              keras.layers.Dense(10)])
    weights = []
    for name in LINEARS:
        weights += [init[f"{name}.weight"].numpy().T, init[f"{name}.bias"].numpy()]
    model.set_weights(weights)
    return model


def export_state_dict(args, model) -> dict[str, torch.Tensor]:
    """The trained Keras weights as the torch MLP's state_dict (kernels transposed back); loading
    it strictly into MLP(hidden) checks every name and shape."""
    values = model.get_weights()
    sd = {}
    for i, name in enumerate(LINEARS):
        sd[f"{name}.weight"] = torch.from_numpy(values[2 * i].T.copy())
        sd[f"{name}.bias"] = torch.from_numpy(values[2 * i + 1].copy())
    MLP(args.hidden).load_state_dict(sd, strict=True)
    return sd


def build_optimizer(tf, args):
    """torch.optim.AdamW(lr, weight_decay=0.01) with the template's linear warmup, in Keras.

    Keras's AdamW decays the weights (w -= lr * wd * w) and then takes Adam's step as torch does,
    but puts epsilon elsewhere: torch divides m / (1 - b1^t) by sqrt(v / (1 - b2^t)) + eps; Keras
    divides m by sqrt(v) + eps and folds both bias corrections into the step size, which is
    torch's formula with eps / sqrt(1 - b2^t) in place of eps: 32x torch's epsilon at step 1.
    Where a gradient is small (1e-6) that changes the update by most of the learning rate.
    Given epsilon eps * sqrt(1 - b2^t), Keras's step is torch's: this subclass supplies it at
    every step (Keras 3 and tf-keras both read self.epsilon there)."""
    keras = tf.keras
    peak_lr = args.lr * args.global_batch / args.base_batch  # the template's linear scaling

    class Warmup(keras.optimizers.schedules.LearningRateSchedule):
        def __call__(self, step):  # step = updates done so far, 0 at the first
            ramp = (tf.cast(step, tf.float32) + 1.0) / args.warmup_steps if args.warmup_steps \
                else 1.0
            return peak_lr * tf.minimum(1.0, ramp)

        def get_config(self):
            return {}

    class TorchAdamW(keras.optimizers.AdamW):
        @property
        def epsilon(self):
            t = tf.cast(self.iterations + 1, tf.float32)
            return self._torch_eps * tf.sqrt(1.0 - tf.pow(tf.cast(self.beta_2, tf.float32), t))

        @epsilon.setter
        def epsilon(self, value):  # Keras's __init__ stores epsilon here
            self._torch_eps = value

    optimizer = TorchAdamW(learning_rate=Warmup(), weight_decay=0.01, beta_1=0.9, beta_2=0.999,
                           epsilon=1e-8)
    return optimizer, peak_lr


# --------------------------------------------------------------------------------------------------
# The strategies


def make_strategy(tf, args, cluster):
    """The tf.distribute strategy of --strategy (on --device), and this process's worker index."""
    gpus = tf.config.list_physical_devices("GPU") if args.device != "cpu" else []
    if args.device == "cuda" and not gpus:
        cli.fail("--device cuda was asked for, but TensorFlow sees no GPU on this machine")
    if not gpus:
        tf.config.set_visible_devices([], "GPU")
    if args.strategy == "one":
        return tf.distribute.OneDeviceStrategy("/gpu:0" if gpus else "/cpu:0"), 0
    if args.strategy == "mirrored":
        if gpus:  # every visible GPU, or the first --replicas of them
            devices = [f"/gpu:{i}" for i in range(min(args.replicas or len(gpus), len(gpus)))]
        else:
            # A CPU is one device to TensorFlow: split it into --replicas logical devices, one
            # replica each (threads of one process, as several GPUs would be).
            replicas = args.replicas or 2
            cpu = tf.config.list_physical_devices("CPU")[0]
            tf.config.set_logical_device_configuration(
                cpu, [tf.config.LogicalDeviceConfiguration()] * replicas)
            devices = [f"/cpu:{i}" for i in range(replicas)]
        # In one process, the replicas' gradients are summed on one device and copied back
        # (NCCL's all-reduce is the default between GPUs, and needs GPUs).
        ops = None if gpus else tf.distribute.ReductionToOneDevice()
        return tf.distribute.MirroredStrategy(devices, cross_device_ops=ops), 0
    # multiworker: collective ops between processes, ring all-reduce on CPU (NCCL between GPUs),
    # and a timeout on every collective, so that a worker that stalls or dies makes the others fail
    # instead of hang (TensorFlow calls it a debugging aid: a thread per collective; its
    # coordination service's 10 s heartbeats catch a dead worker, not a stalled one).
    options = tf.distribute.experimental.CommunicationOptions(
        implementation=tf.distribute.experimental.CommunicationImplementation.NCCL if gpus
        else tf.distribute.experimental.CommunicationImplementation.RING,
        timeout_seconds=args.timeout_s)
    return tf.distribute.MultiWorkerMirroredStrategy(communication_options=options), \
        cluster["index"]


def say_error(line: str) -> None:
    """One line on stderr in one write: the workers share their launcher's stderr, and print()'s
    separate write of the newline would let another worker's line in between."""
    sys.stderr.flush()
    os.write(sys.stderr.fileno(), (line + "\n").encode())


def watch_join(seconds: float, cluster: dict):
    """A process that ends this worker, with one line, unless every worker joined within
    `seconds` of the strategy's start. MultiWorkerMirroredStrategy waits for all the workers of
    TF_CONFIG (up to its coordination service's default hour; no public argument shortens it),
    inside TensorFlow's C++ with Python's lock held (no thread or signal handler of this process
    runs meanwhile), and TensorFlow's runtime catches SIGTERM; so
    the watcher is a process, forked before TensorFlow starts its threads, and ends this one with
    SIGKILL. Returns the pipe end to send "start" to (the clock starts), then "joined"."""
    import multiprocessing as mp
    ours, theirs = mp.get_context("fork").Pipe()
    mp.get_context("fork").Process(target=_watcher, args=(os.getpid(), seconds, cluster, theirs),
                                   daemon=True).start()
    return ours


def _watcher(pid: int, seconds: float, cluster: dict, conn) -> None:
    try:
        conn.recv()  # "start" (importing TensorFlow, which comes first, can take long)
    except EOFError:
        return  # this worker ended first
    if conn.poll(seconds):  # "joined" (or this worker ended: the pipe closed)
        return
    silent = []
    for i, address in enumerate(cluster["workers"]):  # whose gRPC server is not listening?
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host, int(port)), timeout=2).close()
        except (OSError, ValueError):
            silent.append(f"worker {i} at {address}")
    who = ", ".join(silent) if silent else "no listed worker (all listen, yet did not all join)"
    say_error(f"error: worker {cluster['index']}: the {len(cluster['workers'])} workers of "
              f"TF_CONFIG did not all join within --timeout-s {seconds:g}; not answering: {who}")
    os.kill(pid, signal.SIGKILL)


def read_tf_config(args) -> dict | None:
    """TF_CONFIG for --strategy multiworker, checked before any worker starts its server: every
    worker reads its own, so each names its own problem and exits 2."""
    if args.strategy != "multiworker":
        return None
    raw = os.environ.get("TF_CONFIG")
    if not raw:
        cli.fail("--strategy multiworker needs TF_CONFIG (the cluster's workers and this "
                 "worker's index), or --spawn N to start N local workers")
    try:
        config = json.loads(raw)
        workers = config["cluster"]["worker"]
        task = config["task"]
        kind, index = task["type"], task["index"]
    except (ValueError, KeyError, TypeError) as exc:
        cli.fail(f"TF_CONFIG is not {{\"cluster\": {{\"worker\": [host:port, ...]}}, \"task\": "
                 f"{{\"type\": \"worker\", \"index\": i}}}}: {exc.__class__.__name__} {exc}")
    if kind != "worker":
        cli.fail(f"TF_CONFIG task type is {kind!r}: this script runs 'worker' tasks only (a "
                 f"'chief' or 'ps' task belongs to other strategies)")
    if not isinstance(index, int) or not 0 <= index < len(workers):
        cli.fail(f"TF_CONFIG task index {index} is not a worker of the cluster's {len(workers)} "
                 f"(indices 0..{len(workers) - 1})")
    if len(set(workers)) != len(workers):
        cli.fail(f"TF_CONFIG lists a worker address twice: {workers}")
    return {"workers": workers, "index": index}


# --------------------------------------------------------------------------------------------------
# Training: a custom loop, or Keras's model.fit


def global_batch(args, step: int):
    """Step `step`'s global batch as numpy: the template's samples, row for row."""
    x, y = classification_batch(args.seed, step, args.global_batch)
    return x.numpy(), y.numpy()


def train_custom(tf, args, strategy, model, optimizer, timer):
    """The loop written out: each replica takes its rows, computes sum(loss) / global batch and
    its gradients; apply_gradients all-reduces (sums) them across replicas and steps. Returns
    the losses, and the norm of the summed gradient at step 1 (before any update), which
    should be one process's: a loss divided by the replica's own batch would double it."""
    loss_fn = tf.keras.losses.SparseCategoricalCrossentropy(
        from_logits=True, reduction="none")
    B = args.batch_size

    def loss_and_grads(x, y):
        with tf.GradientTape() as tape:
            per_sample = loss_fn(y, model(x, training=True))                      # (B,)
            loss = tf.nn.compute_average_loss(per_sample, global_batch_size=args.global_batch)
        return loss, tape.gradient(loss, model.trainable_variables)

    def replica_step(x, y):
        loss, grads = loss_and_grads(x, y)
        optimizer.apply_gradients(zip(grads, model.trainable_variables))  # all-reduce, update
        return loss

    @tf.function
    def step_fn(x, y):
        per_replica = strategy.run(replica_step, args=(x, y))
        return strategy.reduce(tf.distribute.ReduceOp.SUM, per_replica, axis=None)  # global mean

    @tf.function
    def summed_grad_norm(x, y):  # a probe for the metrics, not part of training
        _, grads = strategy.run(loss_and_grads, args=(x, y))
        summed = [strategy.reduce(tf.distribute.ReduceOp.SUM, g, axis=None) for g in grads]
        return tf.linalg.global_norm(summed)

    losses = []
    for step in range(args.steps):
        x, y = global_batch(args, step)
        # Replica r (counted over all workers) takes rows r*B..(r+1)*B-1, as DDP's rank r does.
        rows = lambda ctx, a: a[ctx.replica_id_in_sync_group * B:  # noqa: E731
                                (ctx.replica_id_in_sync_group + 1) * B]
        dx = strategy.experimental_distribute_values_from_function(lambda ctx: rows(ctx, x))
        dy = strategy.experimental_distribute_values_from_function(lambda ctx: rows(ctx, y))
        if step == 0:
            grad_norm = float(summed_grad_norm(dx, dy))
        losses.append(float(step_fn(dx, dy)))
        timer(step, losses[-1])
    return losses, {"grad_norm_step1": grad_norm}


def train_fit(tf, args, strategy, model, optimizer, timer):
    """Keras's model.fit: one epoch per step, so Keras reports each step's loss. fit splits each
    global batch across the replicas itself (and, between workers, shards the dataset: each
    keeps its share of every batch), and reduces the loss and gradients as the custom loop does."""
    xs, ys = zip(*(global_batch(args, step) for step in range(args.steps)))
    data = tf.data.Dataset.from_tensor_slices((tf.concat(xs, 0), tf.concat(ys, 0)))
    data = data.batch(args.global_batch)
    with strategy.scope():
        model.compile(optimizer=optimizer,
                      loss=tf.keras.losses.SparseCategoricalCrossentropy(from_logits=True))

    class PerStep(tf.keras.callbacks.Callback):
        def on_epoch_end(self, epoch, logs=None):
            losses.append(float(logs["loss"]))
            timer(epoch, losses[-1])

    losses = []
    try:
        model.fit(data, epochs=args.steps, steps_per_epoch=1, verbose=0, shuffle=False,
                  callbacks=[PerStep()])
    except ValueError as exc:
        if args.strategy != "multiworker" or which_keras(tf).startswith("tf-keras"):
            raise
        # Keras 3 passes the per-replica batch where a tensor is expected, on every worker:
        # unsupported in Keras 3 (keras-team/keras#20585; tensorflow/tensorflow#72388).
        first = str(exc).splitlines()[0]
        say_error(f"error: worker {strategy.cluster_resolver.task_id}: {which_keras(tf)}'s "
                  f"model.fit fails under MultiWorkerMirroredStrategy ({type(exc).__name__}: "
                  f"{first} ...), unsupported in Keras 3: use --loop custom, or Keras 2 "
                  f"(TF_USE_LEGACY_KERAS=1, package tf-keras)")
        os._exit(1)  # now, before TensorFlow's shutdown logs the peer that is already gone
    return losses, {}


def which_keras(tf) -> str:
    """tf.keras is Keras 3 (package keras) unless TF_USE_LEGACY_KERAS=1 makes it Keras 2
    (package tf-keras)."""
    if tf.keras.__name__.startswith("tf_keras"):
        import tf_keras
        return f"tf-keras {tf_keras.__version__}"
    import keras
    return f"keras {keras.__version__}"


def train(args, cluster):
    # Before TensorFlow starts: the watcher of the workers' join (multiworker).
    joined = watch_join(args.timeout_s, cluster) if cluster else None
    # TensorFlow's C++ logs errors only, and its own CPU kernels run rather than oneDNN's, which
    # announce at every import that they change results by rounding. Set either to override.
    os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "2")
    os.environ.setdefault("TF_ENABLE_ONEDNN_OPTS", "0")
    import tensorflow as tf
    tf.get_logger().setLevel("ERROR")
    # One thread per op, as the torch scripts use: the same reductions in the same order on every
    # machine (more threads split a matmul's sums differently). Replicas still run concurrently.
    tf.config.threading.set_intra_op_parallelism_threads(1)

    if joined is not None:
        joined.send("start")
    strategy, index = make_strategy(tf, args, cluster)
    replicas = strategy.num_replicas_in_sync
    if joined is not None:  # one all-reduce over every replica: all workers are there
        strategy.reduce(tf.distribute.ReduceOp.SUM, strategy.run(lambda: tf.constant(1.0)),
                        axis=None)
        joined.send("joined")
    args.global_batch = replicas * args.batch_size
    with strategy.scope():  # variables created here are mirrored across the replicas
        model = build_model(tf, args, torch_initial_weights(args))
        optimizer, peak_lr = build_optimizer(tf, args)

    chief = index == 0  # worker 0 prints and writes files, as rank 0 does
    say = print if chief else (lambda *a, **k: None)
    keras_version = which_keras(tf)
    say(f"tensorflow {tf.__version__} | {keras_version} | {STRATEGY_NAMES[args.strategy]} | "
        f"{replicas} replica(s) | global batch {args.global_batch} ({replicas} x "
        f"{args.batch_size}) | lr {peak_lr:g} | loop {args.loop}", flush=True)

    t = {"start": None}

    def timer(step, loss):
        if step == 0:
            # the first step traces and compiles: not timed
            t["start"] = time.perf_counter()  # host clock: TensorFlow's steps, loss read
        done = step + 1
        if done % args.log_every == 0 or done in (1, args.steps):
            say(f"step {done:4d}/{args.steps} | loss {loss:.4f}", flush=True)

    losses, probes = (train_custom if args.loop == "custom" else train_fit)(
        tf, args, strategy, model, optimizer, timer)
    elapsed = time.perf_counter() - t["start"]  # host clock: as above
    samples_per_s = (args.steps - 1) * args.global_batch / elapsed if args.steps > 1 else None
    rate = f"{samples_per_s:.0f} samples/s" if samples_per_s else "samples/s not measured"
    say(f"done: {args.steps} steps, {rate}", flush=True)

    # Every replica holds the whole model: weights, gradients, Adam's two moments (16 B/param).
    P = sum(int(v.shape.num_elements()) for v in model.trainable_variables)
    held = {"param_bytes": 4 * P, "grad_bytes": 4 * P, "optim_bytes": 8 * P, "peak_bytes": None}
    if chief:
        d = SimpleNamespace(world_size=replicas, device="gpu" if "GPU" in str(
            strategy.extended.worker_devices) else "cpu")
        metrics = report.metrics(d, script=SCRIPT, strategy=f"tf-{args.strategy}",
                                 steps=args.steps, global_batch=args.global_batch, losses=losses,
                                 samples_per_s=samples_per_s, per_rank=[held] * replicas,
                                 loop=args.loop, keras_version=str(keras_version),
                                 tensorflow_version=tf.__version__, **probes)
        if args.metrics_out:
            report.write_json(args.metrics_out, metrics)
        if args.export:
            report.save_state_dict(args.export, export_state_dict(args, model))
    # The other workers wait for the chief's files: one last collective, which MWMS needs anyway
    # (a worker that exits early breaks its peers' last all-reduce).
    if args.strategy == "multiworker":
        strategy.reduce(tf.distribute.ReduceOp.SUM,
                        strategy.run(lambda: tf.constant(1.0)), axis=None)


# --------------------------------------------------------------------------------------------------
# --spawn N: start N local workers, each with its TF_CONFIG (what a cluster's scheduler would do)


def free_ports(n: int) -> list[int]:
    """n TCP ports that were free a moment ago (bound to port 0 and released)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def spawn(args, argv) -> int:
    """Start --spawn N workers of this script on localhost; if one fails, stop the others."""
    ports = free_ports(args.spawn)
    workers = [f"127.0.0.1:{p}" for p in ports]
    i = argv.index("--spawn") if "--spawn" in argv else None
    child_argv = argv[:i] + argv[i + 2:] if i is not None else \
        [a for a in argv if not a.startswith("--spawn=")]
    procs = []
    for index in range(args.spawn):
        config = {"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}}
        env = {**os.environ, "TF_CONFIG": json.dumps(config)}
        procs.append(subprocess.Popen([sys.executable, __file__, *child_argv], env=env))
    codes: dict[int, int] = {}
    deadline = None
    while len(codes) < len(procs):
        for index, proc in enumerate(procs):
            if index not in codes and proc.poll() is not None:
                codes[index] = proc.returncode
                if proc.returncode and deadline is None:  # a worker failed: the others follow
                    deadline = time.monotonic() + 10  # host clock: a deadline
        if deadline is not None and time.monotonic() > deadline:  # host clock: as above
            for index, proc in enumerate(procs):
                if index not in codes:
                    proc.kill()  # SIGKILL: TensorFlow's runtime catches SIGTERM
        time.sleep(0.1)
    return max(codes.values(), key=abs)


# --------------------------------------------------------------------------------------------------
# Arguments and launch


def parse_args(argv=None):
    p = cli.parser(__doc__)
    cli.add_run_args(p)
    cli.add_train_args(p, steps=40, batch_size=32, lr=1e-2, grad_accum=False,
                       batch_help="samples per replica per step")
    cli.add_output_args(p)
    cli.add_template_args(p)
    p.add_argument("--strategy", choices=STRATEGIES, default="one",
                   help="one device; one process with several (mirrored); several processes "
                        "(multiworker, from TF_CONFIG)")
    p.add_argument("--replicas", type=int, default=None,
                   help="mirrored: devices to mirror over (default: every visible GPU; on a CPU, "
                        "2 logical devices split from it)")
    p.add_argument("--loop", choices=["custom", "fit"], default="custom",
                   help="a custom training loop, or Keras's model.fit")
    p.add_argument("--spawn", type=int, default=0, metavar="N",
                   help="multiworker: start N local workers, each with its own TF_CONFIG")
    p.add_argument("--log-every", type=int, default=10)
    args = p.parse_args(argv)
    cli.check_positive(args, "steps", "batch_size", "log_every", "lr", "timeout_s", "replicas")
    cli.check_template_args(args)
    if args.spawn and (args.strategy != "multiworker" or "TF_CONFIG" in os.environ
                       or args.spawn < 1):
        cli.fail("--spawn N starts N local workers with their TF_CONFIG: use it with --strategy "
                 "multiworker, N >= 1, and without a TF_CONFIG of your own")
    return args


def main(argv=None):
    argv = sys.argv[1:] if argv is None else argv
    args = parse_args(argv)
    if args.spawn:
        sys.exit(spawn(args, argv))
    cluster = read_tf_config(args)
    train(args, cluster)


if __name__ == "__main__":
    main()
