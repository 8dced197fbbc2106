"""The README opens with the two commands, and CI runs the test command verbatim."""

import os
import re

from harness import REPO


def _read(*parts):
    with open(os.path.join(REPO, *parts)) as f:
        return f.read()


def test_ci_runs_the_readme_test_command():
    commands = re.findall(r"```bash\n(.+?)\n```", _read("README.md"))
    assert len(commands) >= 2
    main_job, tests = commands[0], commands[1]
    assert "benchmarks/bench_gather.py" in main_job or "distributed-ext-bench" in main_job
    assert "pytest" in tests
    assert tests in _read(".ci", "run").splitlines()
