"""pytest plugin for the GPU suite: print a failure's traceback the moment it happens,
so a run cut short by its time limit still shows why a test failed.
Loaded by tools/gpu_runs/run_gpu_suite.sh with ``-p gpu_report``."""


def pytest_runtest_logreport(report):
    if report.failed:
        print(f"\n{report.nodeid} ({report.when}) FAILED:\n{report.longreprtext}", flush=True)
