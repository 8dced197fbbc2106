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


def test_the_readme_points_only_at_what_a_clone_has_and_its_flags_exist():
    readme = _read("README.md")
    assert "../shared" not in readme  # outside the repository: a clone does not have it
    for path in re.findall(r"\]\(([^)#]+)\)", readme):  # every relative link resolves
        if "://" not in path:
            assert os.path.exists(os.path.join(REPO, path)), path
    from distributed_ext import bench

    flags = {a for action in bench_parser_actions(bench) for a in action}
    for line in readme.splitlines():
        if line.startswith("distributed-ext-bench"):
            for flag in re.findall(r"(--[a-z][a-z-]+)", line.split("#")[0]):
                assert flag in flags, (flag, line)


def bench_parser_actions(bench):
    import argparse

    captured = []
    real = argparse.ArgumentParser.parse_args

    def spy(self, args=None, namespace=None):
        captured.extend(a.option_strings for a in self._actions)
        return real(self, ["--no-baseline"], namespace)

    argparse.ArgumentParser.parse_args = spy
    try:
        bench.parse_args([])
    finally:
        argparse.ArgumentParser.parse_args = real
    return captured
