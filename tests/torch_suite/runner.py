"""Runs PyTorch's distributed test suite (``suite.py``) on ``mooncake`` and compares the
outcome with the checked-in list of known outcomes (``known.tsv``).

``known.tsv`` has one line per test that does not pass at some world size:
``name<TAB>world sizes<TAB>outcome<TAB>reason``, where outcome is ``skipped`` (the reason is
torch's own skip message, e.g. "Only Nccl & Gloo backend support DistributedDataParallel") or
``fails`` (a test we cannot pass for a reason outside our code; the reason says which).
Every other test must pass.

From the repository root::

    .venv/bin/python -m tests.torch_suite                  # world sizes 2 and 3, compare with known.tsv
    .venv/bin/python -m tests.torch_suite --world-size 3 -k all_gather
    .venv/bin/python -m tests.torch_suite --write-known    # rewrite known.tsv from a run (review the diff)
"""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET

from tests import REPO_ROOT
from tests.faults import kill_group

HERE = os.path.dirname(os.path.abspath(__file__))
KNOWN_PATH = os.path.join(HERE, "known.tsv")
WORLD_SIZES = (2, 3)
# one test's rank processes get this long before torch's harness kills them (its default is 300 s)
PER_TEST_TIMEOUT_S = 120


@dataclasses.dataclass(frozen=True)
class Outcome:
    outcome: str  # "passed", "skipped", "failed"
    message: str


def run(world_size: int, *, keyword: str | None = None, timeout_s: float = 1500) -> dict:
    """Runs the suite at ``world_size`` in a pytest subprocess (killed as a process group
    after ``timeout_s``); returns {test name: Outcome}."""
    with tempfile.TemporaryDirectory(prefix="mooncake-torch-suite-") as tmp:
        xml = os.path.join(tmp, "junit.xml")
        env = dict(os.environ)
        env.update(
            BACKEND="mooncake",
            WORLD_SIZE=str(world_size),
            TEMP_DIR=tmp,
            DISTRIBUTED_TESTS_DEFAULT_TIMEOUT=str(PER_TEST_TIMEOUT_S),
            PYTHONPATH=REPO_ROOT + os.pathsep + env.get("PYTHONPATH", ""),
        )
        cmd = [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-o",
            "addopts=",
            "--junitxml",
            xml,
            os.path.join(HERE, "suite.py"),
        ]
        if keyword:
            cmd += ["-k", keyword]
        proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            out, _ = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            kill_group(proc, wait_s=10)
            raise TimeoutError(
                f"PyTorch's suite at world size {world_size} did not finish in {timeout_s} s"
            ) from None
        finally:
            kill_group(proc)  # the fork server and any rank process left behind
        if not os.path.exists(xml):
            raise RuntimeError(
                f"PyTorch's suite at world size {world_size} wrote no report; output:\n"
                + out.decode(errors="replace")[-4000:]
            )
        return parse_junit(xml)


def parse_junit(path: str) -> dict:
    """{test name: Outcome} from pytest's JUnit XML report."""
    res = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = case.get("name", "")
        failure = case.find("failure")
        if failure is None:
            failure = case.find("error")
        skipped = case.find("skipped")
        if failure is not None:
            text = (failure.get("message") or "") + "\n" + (failure.text or "")
            res[name] = Outcome("failed", text.strip())
        elif skipped is not None:
            res[name] = Outcome("skipped", _skip_reason(skipped.get("message") or ""))
        else:
            res[name] = Outcome("passed", "")
    return res


def _skip_reason(message: str) -> str:
    # unittest skips arrive as "reason"; pytest may prefix a location or the exception type
    for prefix in ("Skipped: ", "unittest.case.SkipTest: "):
        message = message.removeprefix(prefix)
    # torch prints sets of backend names, whose order changes from one process to the next
    message = re.sub(
        r"\{([^{}]*)\}",
        lambda m: "{" + ", ".join(sorted(x.strip() for x in m.group(1).split(","))) + "}",
        message,
    )
    return " ".join(message.split())


def load_known(path: str = KNOWN_PATH) -> dict:
    """{world size: {test name: Outcome}} of the tests that do not pass (known.tsv)."""
    known: dict = {ws: {} for ws in WORLD_SIZES}
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip() or line.startswith("#"):
                continue
            cells = line.rstrip("\n").split("\t")
            if len(cells) != 4 or cells[2] not in ("skipped", "fails"):
                raise ValueError(f"{path}:{n}: expected name, world sizes, skipped|fails, reason")
            name, sizes, outcome, reason = cells
            for ws in (int(s) for s in sizes.split(",")):
                known.setdefault(ws, {})[name] = Outcome(
                    "skipped" if outcome == "skipped" else "failed", reason
                )
    return known


def differences(world_size: int, got: dict, known: dict) -> list:
    """What differs between a run and known.tsv, one line each (empty: as expected)."""
    exp = known.get(world_size, {})
    out = []
    for name, o in sorted(got.items()):
        k = exp.get(name)
        if o.outcome == "passed":
            if k is not None:
                out.append(f"{name}: passed, known.tsv says {k.outcome} ({k.message}): update it")
        elif o.outcome == "skipped":
            if k is None or k.outcome != "skipped":
                out.append(f"{name}: skipped ({o.message}), not listed in known.tsv")
            elif k.message != o.message:
                out.append(f"{name}: skipped for {o.message!r}, known.tsv says {k.message!r}")
        elif k is None or k.outcome != "failed":
            out.append(f"{name}: FAILED\n{o.message[-3000:]}")
    for name in sorted(set(exp) - set(got)):
        out.append(
            f"{name}: listed in known.tsv but not in torch's suite at world size {world_size}"
        )
    return out


def write_known(results: dict, path: str = KNOWN_PATH) -> None:
    """Rewrites known.tsv from runs at several world sizes ({ws: {name: Outcome}}); reasons of
    failures already listed are kept, new failures get "TODO" (a failure is never listed silently)."""
    old = load_known(path) if os.path.exists(path) else {}
    rows: dict = {}
    for ws, got in sorted(results.items()):
        for name, o in got.items():
            if o.outcome == "passed":
                continue
            if o.outcome == "failed":
                prev = old.get(ws, {}).get(name)
                reason = prev.message if prev is not None and prev.outcome == "failed" else "TODO"
                key = (name, "fails", reason)
            else:
                key = (name, "skipped", o.message)
            rows.setdefault(key, []).append(ws)
    with open(path, "w", encoding="utf-8") as f:
        f.write(
            "# PyTorch's distributed suite on mooncake: the tests that do not pass, and why.\n"
            "# name<TAB>world sizes<TAB>skipped|fails<TAB>reason (skipped: torch's own message)\n"
            "# Written by `python -m tests.torch_suite --write-known`; checked by tests/torch_suite.\n"
        )
        for (name, outcome, reason), sizes in sorted(rows.items()):
            f.write(f"{name}\t{','.join(map(str, sizes))}\t{outcome}\t{reason}\n")
