"""What every script of the course needs that is not its lesson.

    launch   start and stop the process group under python, torchrun, srun, deepspeed and mpirun
    cli      the shared flags (--device --timeout-s --seed --steps ...) and fail(): one line, exit 2
    report   rank-0 printing, the progress bar, per-rank bytes, the metrics JSON, the plain export
    comm     a counter of the collectives a step issues (calls, bytes, dtypes, group sizes)
    profiling  named ranges of a step for torch.profiler (record_function) and nsys (NVTX)
    models   the models more than one lesson trains: the MLP classifier and the GPT
    data     their deterministic synthetic batches: step t's global batch is a function of (seed, t)

Lesson 01's first script (01-ddp-basics/ddp_mnist.py) writes the set-up out in full; every other
script imports it from here, so one implementation is tested under every launcher.
"""
