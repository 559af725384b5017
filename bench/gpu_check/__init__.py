"""Every GPU-only check and benchmark in one command, part by part, into one report.

    python -m bench.gpu_check [--parts a,b,...] [--out DIR] [--budget S] [--dry-run] [--list]

Each part runs in its own process under its own time budget (printed before it starts) and its
result is added to `DIR/gpu_check.json` and `DIR/gpu_check.md` as soon as it ends, so a run cut
off by the machine's time limit still leaves what finished; a later call with other `--parts`
and the same `--out` adds to the same report. The parts are ordered most-likely-to-fail first. One
call fits the GPU machine (a command stopped at 10 minutes, 15 minutes lent in all): a part starts
only while its budget fits in what is left of the call's `--budget` (480 s by default), and the
call ends by printing the one that runs the parts left out.

`--dry-run` (no GPU needed, what CI runs) lists the parts with their budgets and runs, for each
part, everything that does not need CUDA: argument handling, the report's writing and the CPU
side of each comparison at toy sizes.
"""
