"""The latency benchmark (`bazel run //bench`, `bin/dsa bench`; docs in cli.py), by job:

    timing.py     the timing loops and their statistics, the parity bound and the goal, the quiet-machine
                  wait, the machine a timing was taken on
    runtimes.py   the runtimes timed, ready to call: a built vmfb (iree.runtime), ONNX Runtime, ExecuTorch's
                  presence, an environment's interpreter in the runfiles
    subjects.py   what is benchmarked of the project's models: subjects, their builds and reference cases,
                  one subject timed (`bench_subject`), the goal, the profile where it falls short
    lerobot.py    LeRobot policies as built, against LeRobot's eager inference, and their bundles end to end
                  (in the LeRobot environment)
    quant.py      quantised matmuls at OpenVLA's real layer sizes
    report.py     results.json's format, RESULTS.md and results.png, `--update`'s merge
    cli.py        the command line: what runs where, and in which environment

The tuner (dsa/tools/tune.py) uses timing, runtimes, subjects and lerobot; nothing here imports the tuner.
This file imports nothing, so that `import dsa.tools.bench.timing` loads only what it needs.
"""
