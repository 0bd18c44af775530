"""The parts of the throughput-vs-staleness sweep; benchmarks/throughput_vs_staleness.py is the script to run.

Data flows one way: `workloads` (what each max_staleness runs, and its standalone rates) feeds
the script's sweep, whose finished runs `analysis` measures and reports. Neither part imports
the script or the other; `analysis` imports benchmarks/common.py, so benchmarks/ must be on
sys.path, as the script puts it.
"""
