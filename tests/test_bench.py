"""The main job: distributed-ext-bench's parsing, a short real run, Ctrl-C cleanup."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import torch
from harness import REPO, assert_all_ok, run_ranks, run_torchrun

from distributed_ext import bench


@pytest.mark.parametrize(
    "text, value",
    [("1048576", 2**20), ("1024KiB", 2**20), ("512MiB", 512 * 2**20), ("1GiB", 2**30),
     ("1.5GB", 1.5e9), ("2 MiB", 2 * 2**20), ("1gib", 2**30), ("3M", 3 * 2**20),
     ("1TiB", 2**40), ("2TB", 2e12)],
)
def test_parse_size(text, value):
    assert bench.parse_size(text) == int(value)


@pytest.mark.parametrize("text", ["", "abc", "1PB", "-5MiB", "0", "1.2.3GiB", "nanGiB"])
def test_parse_size_rejects_and_names_the_units(text):
    with pytest.raises(argparse.ArgumentTypeError, match="bad size") as info:
        bench.parse_size(text)
    assert "TiB" in str(info.value) and "GB" in str(info.value)


@pytest.mark.parametrize("text", ["0.5", "1", "4096", "0.5MiB"])
def test_sizes_under_a_mebibyte_are_refused_not_rounded(text):
    # --size 0.5 was 0 bytes (failing inside the ranks); --size 1 ran silently at 4 KiB.
    with pytest.raises(argparse.ArgumentTypeError, match="at least 1 MiB"):
        bench.parse_size(text)


def test_parse_args_defaults_and_errors(capsys):
    args = bench.parse_args([])
    assert (args.world, args.sizes, args.repeat, args.workloads) == (
        2, [256 * 2**20], 5, ["bytes", "state-dict"])
    assert bench.parse_args(["--size", "256MiB", "64MiB"]).sizes == [256 * 2**20, 64 * 2**20]
    assert bench.parse_args(["--workload", "bytes"]).workloads == ["bytes"]
    for bad, text in ((["--world", "1"], "--world must be at least 2"),
                      (["--from-json", "missing.json"], "no such file"),
                      (["--size", "lots"], "bad size"), (["--repeat", "0"], "--repeat"),
                      (["--workload", "pickle"], "invalid choice")):
        with pytest.raises(SystemExit) as info:
            bench.parse_args(bad)
        assert info.value.code == 2
        assert text in capsys.readouterr().err


@pytest.mark.parametrize("bad, text", [
    (["--timeout", "0"], "--timeout must be a positive"),
    (["--timeout", "-5"], "--timeout must be a positive"),
    (["--timeout", "nan"], "--timeout must be a positive"),
    (["--timeout", "inf"], "--timeout must be a positive"),
    (["--json", "/nonexistent-dir/out.json"], "--json /nonexistent-dir/out.json: the directory"),
    (["--plot", "/nonexistent-dir/p.png"], "--plot /nonexistent-dir/p.png: the directory"),
])
def test_arguments_that_would_fail_after_the_run_are_refused_before_it(bad, text, capsys):
    with pytest.raises(SystemExit) as info:
        bench.parse_args(bad)
    assert info.value.code == 2 and text in capsys.readouterr().err


def test_plot_from_a_saved_run_without_matplotlib_says_what_to_install(tmp_path, capsys,
                                                                       monkeypatch):
    saved = tmp_path / "run.json"
    saved.write_text("{}")
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if not installed
    with pytest.raises(SystemExit) as info:
        bench.parse_args(["--from-json", str(saved), "--plot", str(tmp_path / "p.png")])
    assert info.value.code == 2
    assert "pip install --no-build-isolation -e '.[plot]'" in capsys.readouterr().err


def test_plot_needs_matplotlib(tmp_path, capsys):
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        with pytest.raises(SystemExit):
            bench.parse_args(["--plot", str(tmp_path / "p.png")])
        assert "pip install" in capsys.readouterr().err
    else:
        results = [bench.Result("bytes", m, 2, 100, 100, 1.0, [0.5, 0.6], [10]) for m in
                   ("distributed_ext", "torch gather_object")]
        bench.plot(results, str(tmp_path / "p.png"))
        assert (tmp_path / "p.png").stat().st_size > 1000


def test_memory_is_refused_up_front_with_the_numbers(monkeypatch):
    monkeypatch.setattr(bench.resources, "available_bytes", lambda: 2 * 2**30)
    with pytest.raises(SystemExit) as info:
        bench.check_memory(2**30, 2, baseline=True)
    msg = str(info.value)
    assert "1 GiB" in msg and "2 GiB is available" in msg and "--no-baseline" in msg
    bench.check_memory(2**20, 2, baseline=True)  # small enough: no error


def test_every_workload_is_refused_up_front_for_memory_and_disk(monkeypatch, tmp_path):
    import shutil
    from collections import namedtuple

    monkeypatch.setattr(bench.resources, "available_bytes", lambda: 8 * 2**30)
    with pytest.raises(SystemExit) as info:  # every rank builds the model: 2 x 100 GiB
        bench.check_memory(100 * 2**30, 2, baseline=True, workload="export")
    assert "--workload export" in str(info.value) and "8 GiB is available" in str(info.value)
    monkeypatch.setattr(bench.resources, "available_bytes", lambda: 2**40)
    monkeypatch.setenv("DEXT_BENCH_DIR", str(tmp_path))
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**40, 0, 10 * 2**30))
    with pytest.raises(SystemExit) as info:  # a 100 GiB model's checkpoint, twice for DCP
        bench.check_memory(100 * 2**30, 2, baseline=True, workload="export")
    msg = str(info.value)
    assert "200.1 GiB" in msg and str(tmp_path) in msg and "10 GiB free" in msg, msg
    assert "DEXT_BENCH_DIR" in msg
    bench.check_memory(1 * 2**30, 2, baseline=True, workload="export")  # fits: no error
    # Through the command: refused before any rank starts or anything is written.
    proc = subprocess.run(
        [sys.executable, "-m", "distributed_ext.bench", "--workload", "export", "--size",
         "100TiB"], capture_output=True, text=True, timeout=120,
        env={**os.environ, "DEXT_BENCH_DIR": str(tmp_path)})
    assert proc.returncode != 0 and "needs about" in proc.stderr, proc.stderr[-2000:]
    assert os.listdir(tmp_path) == []


def test_from_json_that_is_not_ours_is_a_message_not_a_traceback(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("{}")
    assert bench.main(["--from-json", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "not a file written by --json" in err and "Traceback" not in err


def test_export_needs_its_extra_up_front(monkeypatch, capsys):
    monkeypatch.setattr(bench.cli, "_importable", lambda name: name != "transformers")
    with pytest.raises(SystemExit):
        bench.parse_args(["--workload", "export"])
    assert "pip install --no-build-isolation -e '.[export]'" in capsys.readouterr().err


@pytest.mark.parametrize("what", ["missing", "file"])
def test_a_bad_bench_dir_is_a_usage_error_before_any_rank_starts(what, tmp_path, monkeypatch,
                                                                  capsys):
    where = tmp_path / "nowhere"
    if what == "file":
        where.write_text("x")
    monkeypatch.setenv("DEXT_BENCH_DIR", str(where))
    monkeypatch.setattr(bench.cli, "_importable", lambda name: True)
    with pytest.raises(SystemExit) as info:
        bench.parse_args(["--workload", "export"])
    assert info.value.code == 2  # argparse's usage error, not a traceback
    err = capsys.readouterr().err
    assert f"DEXT_BENCH_DIR={str(where)!r}" in err
    assert ("is not a directory" if what == "file" else "does not exist") in err
    monkeypatch.setenv("DEXT_BENCH_DIR", str(tmp_path))
    assert bench.parse_args(["--workload", "export"]).workloads == ["export"]


def test_the_export_extra_holds_what_the_export_needs():
    import tomllib

    with open(os.path.join(REPO, "pyproject.toml"), "rb") as f:
        extras = tomllib.load(f)["project"]["optional-dependencies"]
    names = {re.split(r"[=<>]", d)[0] for d in extras["export"]}
    assert {"transformers", "safetensors"} <= names


def _interrupt_export_bench(tmp_path, signum, after):
    """Runs the export bench in a new session, signals it after ``after`` seconds, or
    (``after`` "writing") once its first checkpoint is being written into ``tmp_path``."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "distributed_ext_cli", "--workload", "export", "--size",
         "64MiB", "--repeat", "50", "--quiet"], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,
        env={**os.environ, "DEXT_BENCH_DIR": str(tmp_path), "OMP_NUM_THREADS": "1"})
    try:
        if after == "writing":
            deadline = time.monotonic() + 120
            while not os.listdir(tmp_path) and proc.poll() is None and \
                    time.monotonic() < deadline:
                time.sleep(0.05)
            assert os.listdir(tmp_path), "the bench wrote nothing within 120 s"
            time.sleep(0.2)  # (inside the call: its files being written)
        else:
            time.sleep(after)
        os.kill(proc.pid, signum)
        out, err = proc.communicate(timeout=60)
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.returncode, out, err


@pytest.mark.parametrize("signum, after", [(signal.SIGINT, 1.0), (signal.SIGINT, "writing"),
                                           (signal.SIGTERM, "writing")])
def test_the_export_bench_leaves_nothing_behind_on_ctrl_c_or_sigterm(signum, after, tmp_path):
    code, out, err = _interrupt_export_bench(tmp_path, signum, after)
    assert code in (130, 128 + signal.SIGTERM, -signal.SIGTERM), (code, err[-2000:])
    assert "Traceback" not in err, err[-3000:]
    assert os.listdir(tmp_path) == [], os.listdir(tmp_path)


def test_make_state_is_llm_shaped_and_sized():
    state = bench.make_state(48 * 2**20)
    assert sum(t.numel() * t.element_size() for t in state.values()) == 48 * 2**20
    assert any(t.shape == (4096, 4096) for t in state.values())
    assert sum(1 for t in state.values() if t.numel() <= 4096) >= 100


def test_short_real_run_world_2(tmp_path, capsys):
    out = tmp_path / "figures.json"
    code = bench.main(["--world", "2", "--size", "2MiB", "--repeat", "2", "--quiet",
                       "--json", str(out), "--timeout", "120"])  # ranks stopped after 120 s
    assert code == 0
    doc = json.loads(out.read_text())
    rows = doc["results"]
    assert [(r["workload"], r["method"]) for r in rows] == [
        ("bytes", "distributed_ext"), ("bytes", "raw gloo send/recv"),
        ("bytes", "torch gather_object"), ("bytes", "first-touch floor"),
        ("state-dict", "distributed_ext"), ("state-dict", "torch save+gather_object+load")]
    for r in rows:  # every call is kept: the first, and each warm one
        assert r["world"] == 2 and r["size"] == 2 * 2**20 and r["first"] > 0
        assert len(r["warm"]) == 2 and all(t > 0 for t in r["warm"]) and r["fresh_ranks"]
        assert r["received"] == r["size"]  # one other rank's bytes reach dst
    env = doc["environment"]
    for key in ("python", "torch", "distributed_ext", "cores", "memory_bytes", "date", "host"):
        assert env[key], key
    table = capsys.readouterr().out
    assert "| first call s | warm median s | warm min-max s |" in table
    assert "bytes dst receives from the other ranks" in table  # the GB/s definition
    assert "first call vs raw gloo's first call" in table
    # --plot and the table from the saved JSON, without running anything.
    assert bench.main(["--from-json", str(out)]) == 0
    again = capsys.readouterr().out
    assert "from " + str(out) in again and "distributed_ext" in again


def test_targets_are_judged_from_the_figures():
    def row(method, first, warm, size=256 * 2**20):
        return bench.Result("bytes", method, 2, size, size, first, warm, [0])

    results = [row("distributed_ext", 0.2, [0.1, 0.11, 0.12]),
               row("raw gloo send/recv", 0.2, [0.2]),
               row("torch gather_object", 1.0, [2.0]),
               row("first-touch floor", 0.1, [0.05])]
    lines = bench.check_targets(results)
    assert any(line.startswith("met ") and "raw gloo's first call: 1.00x" in line for line in lines)
    assert any(line.startswith("met ") and "gather_object's first call: 5.00x" in line
               for line in lines)
    assert any(line.startswith("met ") and "warm vs gather_object warm: 18.18x" in line
               for line in lines)
    assert any(line.startswith("met ") and "max/min" in line for line in lines)
    assert any(line.startswith("MISSED") and "first-touch floor" in line for line in lines)


def test_export_targets_name_the_filesystems_ceiling_beside_the_speed_ratios():
    def row(method, first):
        return bench.Result("export", method, 2, 2**29, 2**30, first, [first], [0])

    results = [row("distributed_ext", 0.8), row("distributed_ext writers=dst", 1.0),
               row("torch get_model_state_dict+save_pretrained", 3.5),
               row("disk O_DIRECT write", 0.72),
               row("disk O_DIRECT write, every rank its share", 0.75)]
    lines = [line for line in bench.check_targets(results) if "every rank writing" in line]
    assert any(line.startswith("MISSED") and "vs writers=dst: 1.25x (target >= 1.6x; this "
               "filesystem's ceiling 1.39x" in line for line in lines), lines
    assert any(line.startswith("MISSED") and "vs route (b): 4.38x (target >= 5.0x; this "
               "filesystem's ceiling 4.86x" in line for line in lines), lines
    assert any(line.startswith("met ") and "rate vs the disk's O_DIRECT: 0.90x (target >= "
               "0.8x)" in line for line in lines), lines
    assert len(lines) == 4


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_ctrl_c_stops_every_local_rank():
    proc = subprocess.Popen(
        [sys.executable, "-m", "distributed_ext.bench", "--world", "2", "--size", "64MiB",
         "--repeat", "1000", "--workload", "bytes", "--no-baseline", "--quiet"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        line = proc.stdout.readline()
        while "pids" not in line and line:  # (the warm-up's announcement comes first)
            line = proc.stdout.readline()
        pids = [int(p) for p in re.findall(r"\d+", line.split("pids", 1)[1].split(")")[0])]
        assert len(pids) == 2, line
        time.sleep(4)  # the ranks are set up and gathering
        assert proc.poll() is None and all(_alive(p) for p in pids)
        os.killpg(proc.pid, signal.SIGINT)  # what a terminal's Ctrl-C does
        code = proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert code == 130, proc.stderr.read()
    assert "interrupted" in proc.stderr.read()
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(p) for p in pids), "a local rank outlived the benchmark"


def test_under_torchrun_on_cpu(tmp_path):
    # A launch: the command joins it (gloo on a CPU-only node) instead of spawning ranks.
    out = tmp_path / "figures.json"
    proc = run_torchrun(["-m", "distributed_ext.bench", "--size", "1MiB", "--repeat", "1",
                         "--quiet", "--json", str(out)], timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "torchrun, 2 ranks, gloo" in proc.stdout
    rows = json.loads(out.read_text())["results"]
    assert len(rows) == 6 and all(r["world"] == 2 for r in rows)
    assert not any(r["fresh_ranks"] for r in rows)  # a launch's ranks are shared


def test_baseline_without_numpy_is_refused_up_front(monkeypatch, capsys):
    # torch's gather_object converts through numpy; without it the run would die mid-way.
    monkeypatch.setitem(sys.modules, "numpy", None)
    with pytest.raises(SystemExit):
        bench.parse_args([])
    assert "needs numpy" in capsys.readouterr().err
    assert bench.parse_args(["--no-baseline"]).no_baseline is True


def test_progress_bar_draws_and_finishes(capsys):
    bar = bench.ProgressBar("bytes (distributed_ext) 1/3", enabled=True)
    bar(0, 10**9)
    bar(10**9 // 2, 10**9)
    bar(10**9 // 2 + 2**20, 10**9)  # +1 MiB: under 2% and 32 MiB, not redrawn
    bar(10**9, 10**9)
    err = capsys.readouterr().err
    assert "[" + "#" * 15 + " " * 15 + "]" in err  # half way
    # GB, like the rate beside it (not GiB beside GB/s).
    assert "0.50/1.00 GB" in err and "1.00/1.00 GB" in err and "GiB" not in err
    assert err.count("\r") == 3  # 0, half, done
    assert "#" * 30 in err and err.endswith("\n")
    step = bench.ProgressBar("x", enabled=True)
    for done in range(0, 2**30 + 1, 2**24):  # 16 MiB steps of 1 GiB: every 2nd is drawn
        step(done, 2**30)
    assert capsys.readouterr().err.count("\r") == 33
    quiet = bench.ProgressBar("x", enabled=False)
    quiet(1, 2)
    assert capsys.readouterr().err == ""


def test_export_workload_reports_ours_beside_torchs_routes_and_the_disk(tmp_path, capsys,
                                                                         monkeypatch):
    monkeypatch.setenv("DEXT_BENCH_DIR", str(tmp_path))
    code = bench.main(["--world", "2", "--workload", "export", "--size", "24MiB", "--repeat",
                       "1", "--quiet", "--json", str(tmp_path / "e.json"), "--timeout", "200"])
    assert code == 0
    rows = json.loads((tmp_path / "e.json").read_text())["results"]
    assert [r["method"] for r in rows] == bench.METHODS["export"]
    assert all(r["first"] > 0 and r["received"] > 20 * 2**20 for r in rows)
    out = capsys.readouterr().out
    assert "first call vs the faster torch route" in out and "write rate vs the disk's" in out
    assert os.listdir(tmp_path) == ["e.json"]  # every checkpoint removed after its call


def test_many_tensors_scenario_prints_both_routes_the_ratios_and_the_filesystem(
        tmp_path, capsys, monkeypatch):
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "bench_export_script", os.path.join(REPO, "benchmarks", "bench_export.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setenv("DEXT_BENCH_DIR", str(tmp_path))
    assert module.main(["--many", "--many-world", "2", "--many-entries", "200",
                        "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    for route, entries in (("distributed_ext", 200), ("distributed_ext", 2),
                           ("torch full_tensor()+save_file", 200)):
        assert f"| {route} | {entries} |" in out
    assert "many / few entries, warm" in out and "torch's route / ours" in out
    assert f"writing to {tmp_path}" in out and "load average" in out
    assert os.listdir(tmp_path) == []  # every checkpoint removed after its call


def test_a_call_without_progress_of_its_own_shows_a_line_even_when_short(capsys):
    with bench.Running("bytes (raw gloo send/recv) 1/3", enabled=True):
        pass  # shorter than a redraw
    err = capsys.readouterr().err
    assert "bytes (raw gloo send/recv) 1/3" in err and "running" in err


def test_the_tp_scenario_prints_each_route_beside_writers_all_with_their_ratios(tmp_path):
    from distributed_ext._timing import Timing

    rows = [("writers=all", Timing(1.0, [0.5, 0.7, 0.6]), [(100e6, 0), (0, 50e6)]),
            ("writers=dst", Timing(1.5, [0.9, 0.9]), [(150e6, 0), (0, 50e6)]),
            ("torch full_tensor()+save_file", Timing(4.0, [3.0]), [(200e6, 10e6), (9, 9)])]
    lines = bench.format_tp(rows, 2, 2**30, 2048, str(tmp_path), (1.0, 2.0, 3.0))
    assert "world 2" in lines[0] and "2048 bytes" in lines[0] and "1.00 2.00 3.00" in lines[0]
    assert "| writers=all | 1.000 | 0.600 | 0.500-0.700 | 100/0, 0/50 |" in lines
    assert "| torch full_tensor()+save_file | 4.000 | 3.000 | 3.000-3.000 | -/-, -/- |" \
        in lines
    assert "  writers=dst / writers=all: first call 1.50x, warm 1.50x" in lines
    assert "  torch's route / writers=all: first call 4.00x, warm 5.00x" in lines


def test_the_fsdp_tp_scenario_judges_ours_against_transformers_save_and_the_disk(tmp_path):
    from distributed_ext._timing import Timing

    io = [(300e6, 10e6)] * 4
    rows = [("writers=all", Timing(1.0, [0.8, 1.2]), io),
            ("writers=dst", Timing(1.5, [1.5]), io),
            ("transformers gather_full_state_dict+save_pretrained", Timing(6.0, [4.0]), io),
            ("disk O_DIRECT write", Timing(0.9, [0.7]), [(1074e6, 0)] + [(0, 0)] * 3),
            ("disk O_DIRECT write, every rank its share", Timing(0.7, [0.9]), io)]
    lines = bench.format_fsdp_tp(rows, 4, 2**30, str(tmp_path), (1.0, 2.0, 3.0))
    assert "mesh 2 x 2, world 4" in lines[0] and "_StridedShard(0, 2)" in lines[0]
    assert "| writers=all | 1.000 | 1.000 | 0.800-1.200 | 300/10, 300/10, 300/10, 300/10 |" \
        in lines
    assert ("| transformers gather_full_state_dict+save_pretrained | 6.000 | 4.000 | "
            "4.000-4.000 | -/-, -/-, -/-, -/- |") in lines
    assert "| disk O_DIRECT write | 0.900 | 0.700 | 0.700-0.700 | 1074/-, 0/-, 0/-, 0/- |" \
        in lines
    assert "  met  transformers' save / ours, first call: 6.00x (target >= 5.0x)" in lines
    assert "  MISSED transformers' save / ours, warm: 4.00x (target >= 5.0x)" in lines
    assert ("  met  ours vs the disk's O_DIRECT rate (dst alone), first call: 0.90x "
            "(target >= 0.8x)") in lines
    assert ("  MISSED ours vs the disk's O_DIRECT rate, every rank its share, first call: "
            "0.70x (target >= 0.8x)") in lines
    with pytest.raises(ValueError, match="--world 3: FSDP x TP needs an even world"):
        bench.measure_fsdp_tp(3, 2**20, 0, str(tmp_path))


def test_launches_merge_into_the_median_first_call_with_each_launch_shown(tmp_path):
    from distributed_ext._timing import Timing, merge_launches

    merged = merge_launches([Timing(1.2, [0.9]), Timing(0.8, [0.7, 1.1]), Timing(1.0, [])])
    assert merged == Timing(1.0, [0.9, 0.7, 1.1], [1.2, 0.8, 1.0])
    one = Timing(0.5, [0.4])
    assert merge_launches([one]) is one and one.firsts == []
    with pytest.raises(ValueError, match="no timings"):
        merge_launches([])
    # The table shows each launch's first call; the verdict is the medians' ratio, beside
    # each launch's ratio paired with the same round's baseline.
    io = [(300e6, 10e6)] * 4
    ours = merge_launches([Timing(1.0, [0.9]), Timing(1.4, [1.0]), Timing(0.9, [0.8])])
    disk = merge_launches([Timing(0.9, [0.8]), Timing(0.8, [0.8]), Timing(0.6, [0.7])])
    save = merge_launches([Timing(6.0, [4.0]), Timing(7.0, [4.0]), Timing(5.0, [4.0])])
    rows = [("writers=all", ours, io), ("writers=dst", ours, io),
            ("transformers gather_full_state_dict+save_pretrained", save, io),
            ("disk O_DIRECT write", disk, io),
            ("disk O_DIRECT write, every rank its share", disk, io)]
    lines = bench.format_fsdp_tp(rows, 4, 2**30, str(tmp_path), (1.0, 2.0, 3.0))
    assert lines[1].startswith("| route | first call s: median (each of 3 launches) |")
    assert "| writers=all | 1.000 (1.000, 1.400, 0.900) | 0.900 | 0.800-1.000 |" in "\n".join(
        lines)
    assert ("  met  ours vs the disk's O_DIRECT rate (dst alone), first call: 0.80x (target "
            ">= 0.8x; each launch 0.90x, 0.57x, 0.67x)") in lines
    assert ("  met  transformers' save / ours, first call: 6.00x (target >= 5.0x; each launch "
            "6.00x, 5.00x, 5.56x)") in lines


def _route_rank(route: str, order: str) -> dict | None:
    """A route that only records when it ran (for the launches' order) and times nothing."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return None
    with open(order, "a") as f:
        f.write(route + "\n")
    first = {"a": 1.0, "b": 2.0}[route] + sum(1 for _ in open(order)) / 100
    return {"timing": {"first": first, "warm": [first / 2]},
            "io": [(10, 1, 5 * len(open(order).read())), (20, 2, 3)]}


def test_routes_take_turns_in_fresh_launches(tmp_path, monkeypatch):
    import importlib

    from distributed_ext.bench.measure import routes_in_fresh_ranks

    measure = importlib.import_module("distributed_ext.bench.measure")  # (the module)

    order = str(tmp_path / "order")
    synced: list[int] = []  # (the page cache written out before each route, outside timing)
    sync = measure.os.sync
    monkeypatch.setattr(measure.os, "sync", lambda: synced.append(1) or sync())
    rows = routes_in_fresh_ranks("test", ("a", "b"), _route_rank, 2, order, launches=3)
    assert len(synced) == 6
    with open(order) as f:
        assert f.read().split() == ["a", "b"] * 3  # round by round, in fresh ranks each
    (a, ta, io_a), (b, tb, _io_b) = rows
    assert (a, b) == ("a", "b")
    assert ta.firsts == [1.01, 1.03, 1.05] and ta.first == 1.03
    assert tb.firsts == [2.02, 2.04, 2.06] and len(tb.warm) == 3
    assert io_a == [(10, 1, 5 * 10), (20, 2, 3)]  # (each figure the largest of the launches)
    with pytest.raises(ValueError, match="launches must be a positive int"):
        routes_in_fresh_ranks("test", ("a",), _route_rank, 2, order, launches=0)


def _cached_route_rank(route: str) -> dict | None:
    """Route "save" returns before its bytes are on the disk: dst reports each call's fsync."""
    import torch.distributed as dist

    if dist.get_rank() != 0:
        return None
    value = {"timing": {"first": 2.0, "warm": [1.0, 1.5]}, "io": [(10, 1), (20, 2)]}
    if route == "save":
        value["flushed"] = [0.5, 0.25, 0.75]
    return value


def test_a_route_that_returns_before_its_bytes_are_durable_gets_a_row_until_they_are(
        tmp_path):
    from distributed_ext._timing import Timing
    from distributed_ext.bench.measure import durable_route, routes_in_fresh_ranks
    from distributed_ext.bench.tp import _durable_lines

    rows = routes_in_fresh_ranks("test", ("ours", "save"), _cached_route_rank, 2, launches=2)
    assert [r for r, _t, _io in rows] == ["ours", "save", "save, then fsync of its files"]
    durable = rows[2][1]
    assert durable.firsts == [2.5, 2.5] and sorted(durable.warm) == [1.25, 1.25, 2.25, 2.25]
    assert rows[2][2] == rows[1][2]  # (the route's own bytes)
    get = {r: t for r, t, _io in rows}
    assert _durable_lines(get, "its save", "save", Timing(1.25, [1.0])) == [
        "  (no target) its save until its files are on the disk (then fsync) / ours: first "
        "call 2.00x, warm 1.75x"]
    assert _durable_lines(get, "ours", "ours", Timing(1.0)) == []  # (no such row)
    assert durable_route("save") == "save, then fsync of its files"


def _time_a_cached_baseline(out: str) -> dict | None:
    import torch.distributed as dist

    from distributed_ext.bench.measure import _time_routes

    def baseline(path: str) -> None:  # (rank 0 writes through the page cache, no fsync)
        if dist.get_rank() == 0:
            os.makedirs(path)
            with open(os.path.join(path, "model.safetensors"), "wb") as f:
                f.write(b"x" * 2**20)
        dist.barrier()

    value = _time_routes("save", None, baseline, out, 2, cached=True)
    plain = _time_routes("save", None, baseline, out, 1)
    return None if value is None else {**value, "plain": sorted(plain)}


def test_time_routes_times_a_cached_baselines_fsync_after_each_call(tmp_path):
    out = str(tmp_path / "out")
    value = assert_all_ok(run_ranks(_time_a_cached_baseline, 2, out, timeout=120))[0]
    assert len(value["flushed"]) == 3 and all(f >= 0 for f in value["flushed"])
    assert value["plain"] == ["io", "timing"]  # (not asked: no fsync, no "flushed")
    assert os.listdir(tmp_path) == []  # (every call's directory removed by dst)


def test_fsync_tree_fsyncs_every_file_then_the_directories(tmp_path, monkeypatch):
    from distributed_ext.bench import resources

    (tmp_path / "ckpt" / "sub").mkdir(parents=True)
    for name in ("ckpt/a.safetensors", "ckpt/sub/b.json"):
        (tmp_path / name).write_bytes(b"x" * 100)
    synced = []
    real = os.fsync
    monkeypatch.setattr(resources.os, "fsync",
                        lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or real(fd))
    seconds = resources.fsync_tree(str(tmp_path / "ckpt"))
    assert seconds >= 0
    root = str(tmp_path / "ckpt")
    assert sorted(synced[:2]) == [f"{root}/a.safetensors", f"{root}/sub/b.json"]
    assert synced[2:] == [f"{root}/sub", root]  # (directories after their files)
    synced.clear()
    assert resources.fsync_tree(str(tmp_path / "missing")) >= 0 and synced == []


def test_peak_rss_counts_the_blocks_own_peak_only():
    from distributed_ext.bench.resources import PeakRSS

    big = torch.ones(64 * 2**20, dtype=torch.uint8)  # an earlier peak, before the block
    del big
    with PeakRSS() as quiet:
        pass
    with PeakRSS() as busy:
        held = torch.ones(48 * 2**20, dtype=torch.uint8)  # (touched: every page resident)
        del held
    assert quiet.added < 8 * 2**20, quiet.added
    assert 44 * 2**20 <= busy.added < 64 * 2**20, busy.added


@pytest.mark.parametrize("experts,size", [(128, 2**30), (128, 4 * 2**30), (64, 2**30)])
def test_the_quantized_moe_is_about_the_size_asked(experts, size):
    # --quantize --moe E: the Qwen3-MoE built from the config has about `size` bytes of bf16
    # parameters (counted on the meta device), with E experts a layer.
    pytest.importorskip("transformers", reason="the MoE is transformers' Qwen3-MoE")
    from transformers import Qwen3MoeForCausalLM

    from distributed_ext.bench.quantized import _moe_config

    config = _moe_config(size, experts)
    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(config)
    nbytes = 2 * sum(p.numel() for p in model.parameters())
    assert abs(nbytes - size) < 0.15 * size, (nbytes / 2**30, config.num_hidden_layers)
    assert model.model.layers[0].mlp.experts.gate_up_proj.shape[0] == experts
