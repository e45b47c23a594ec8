"""Include checks of the C++ tree (run by scripts/lint.sh).

1. The torch-free folders (``csrc/core``, ``csrc/transport``, ``csrc/ep``) include nothing
   from torch, ATen, c10 or pybind11, also through the project headers they include.
2. At most ``MAX_TORCH_TUS`` translation units of the CPU build (the sources setup.py
   compiles with RDMA on and CUDA off) include torch headers, directly or through project
   headers: each such unit preprocesses to 4 to 10 times the lines of a torch-free one.

Includes are followed the way the compiler finds them (``"x"`` next to the including file,
then under ``csrc/``); ``#if``/``#ifdef`` blocks on the ``MOONCAKE_WITH_*`` macros are
evaluated for the build in question, any other condition counts both of its branches.
The source list is setup.py's ``SOURCES`` dict, read without running setup.py.

    python3 scripts/check_includes.py [--list]     (--list: print every torch-including unit)

Exit status 0 when both checks pass.
"""

import ast
import glob
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CSRC = os.path.join(ROOT, "csrc")
TORCH_FREE_DIRS = ("core", "transport", "ep")
MAX_TORCH_TUS = 10
TORCH_PREFIXES = ("torch/", "ATen/", "c10/")
FORBIDDEN_IN_CORE = TORCH_PREFIXES + ("pybind11/",)

INCLUDE = re.compile(r'^\s*#\s*include\s*([<"])([^>"]+)[>"]')
DIRECTIVE = re.compile(r"^\s*#\s*(if|ifdef|ifndef|elif|else|endif)\b(.*)$")
DEFINED = re.compile(r"defined\s*\(?\s*(\w+)\s*\)?")


def setup_sources():
    """setup.py's SOURCES: {part: [glob, ...]} (a literal, read with ast)."""
    with open(os.path.join(ROOT, "setup.py")) as f:
        tree = ast.parse(f.read())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "SOURCES" for t in node.targets
        ):
            return ast.literal_eval(node.value)
    raise SystemExit("check_includes: setup.py has no SOURCES dict")


def expand(globs):
    out = []
    for g in globs:
        out += glob.glob(os.path.join(ROOT, g))
    return sorted(set(out))


def eval_condition(kind, text, defines):
    """True/False for a condition on MOONCAKE_WITH_* macros only, else None (unknown)."""
    text = text.split("//")[0].strip()
    if kind in ("ifdef", "ifndef"):
        name = text.split()[0] if text else ""
        if not name.startswith("MOONCAKE_WITH_"):
            return None
        return (name in defines) == (kind == "ifdef")
    names = DEFINED.findall(text)
    rest = DEFINED.sub("", text)
    if not names or not all(n.startswith("MOONCAKE_WITH_") for n in names):
        return None
    if re.sub(r"[\s()!&|]", "", rest):
        return None
    tokens = re.findall(r"defined\s*\(?\s*\w+\s*\)?|&&|\|\||!|\(|\)", text)
    return _parse_or(tokens, defines)


def _parse_or(tokens, defines):
    value = _parse_and(tokens, defines)
    while tokens and tokens[0] == "||":
        tokens.pop(0)
        value = _parse_and(tokens, defines) or value
    return value


def _parse_and(tokens, defines):
    value = _parse_unary(tokens, defines)
    while tokens and tokens[0] == "&&":
        tokens.pop(0)
        value = _parse_unary(tokens, defines) and value
    return value


def _parse_unary(tokens, defines):
    tok = tokens.pop(0)
    if tok == "!":
        return not _parse_unary(tokens, defines)
    if tok == "(":
        value = _parse_or(tokens, defines)
        tokens.pop(0)  # ")"
        return value
    return DEFINED.match(tok).group(1) in defines


def includes(path, defines):
    """The (kind, name) includes of one file that are compiled under `defines`."""
    out = []
    # stack of [taking this branch (True/False/None = unknown), a branch was taken]
    stack = []
    with open(path, errors="replace") as f:
        for line in f:
            d = DIRECTIVE.match(line)
            if d:
                kind, text = d.group(1), d.group(2)
                if kind in ("if", "ifdef", "ifndef"):
                    c = eval_condition(kind, text, defines)
                    stack.append([c, c is True])
                elif kind == "elif" and stack:
                    top = stack[-1]
                    c = eval_condition("if", text, defines)
                    if top[1] and top[0] is not None:
                        top[0] = False
                    else:
                        top[0] = c
                        top[1] = top[1] or c is True
                elif kind == "else" and stack:
                    top = stack[-1]
                    top[0] = None if top[0] is None else not top[1]
                elif kind == "endif" and stack:
                    stack.pop()
                continue
            if any(s[0] is False for s in stack):
                continue
            m = INCLUDE.match(line)
            if m:
                out.append((m.group(1), m.group(2)))
    return out


def resolve(kind, name, including):
    """The project file an include names, or None for a system/third-party header."""
    cands = [os.path.join(os.path.dirname(including), name)] if kind == '"' else []
    cands.append(os.path.join(CSRC, name))
    for c in cands:
        if os.path.isfile(c):
            return os.path.normpath(c)
    return None


def closure(path, defines, memo):
    """{external header: chain of project files that leads to it} for one file."""
    key = (path, defines)
    if key in memo:
        return memo[key]
    memo[key] = {}  # a cycle ends here
    found = {}
    for kind, name in includes(path, defines):
        target = resolve(kind, name, path)
        if target is None:
            found.setdefault(name, [path])
        else:
            for ext, chain in closure(target, defines, memo).items():
                found.setdefault(ext, [path] + chain)
    memo[key] = found
    return found


def rel(p):
    return os.path.relpath(p, ROOT)


def main(argv):
    sources = setup_sources()
    memo = {}
    rc = 0
    cpu = frozenset({"MOONCAKE_WITH_RDMA"})
    full = frozenset({"MOONCAKE_WITH_RDMA", "MOONCAKE_WITH_CUDA"})

    # 1. torch-free folders: every file, in every build; one line per offending include
    bad = {}
    for d in TORCH_FREE_DIRS:
        for path in sorted(glob.glob(os.path.join(CSRC, d, "**", "*"), recursive=True)):
            if not path.endswith((".cpp", ".hpp", ".h", ".cu", ".cuh")):
                continue
            for defines in (cpu, full):
                for ext, chain in closure(path, defines, memo).items():
                    if ext.startswith(FORBIDDEN_IN_CORE):
                        bad.setdefault((rel(chain[-1]), ext), chain)
    for (culprit, ext), chain in sorted(bad.items()):
        print(
            f"[includes] ERROR {culprit} includes <{ext}>, which a torch-free folder "
            f"({', '.join('csrc/' + d for d in TORCH_FREE_DIRS)}) must not: "
            f"{' -> '.join(rel(c) for c in chain)}"
        )
    if bad:
        rc = 1

    # 2. torch-including translation units of the CPU build
    tus = expand(sources["cpu"] + sources["rdma"])
    torch_tus = []
    for tu in tus:
        hits = [e for e in closure(tu, cpu, memo) if e.startswith(TORCH_PREFIXES)]
        if hits:
            torch_tus.append((tu, sorted(hits)[0]))
    verdict = "ok" if len(torch_tus) <= MAX_TORCH_TUS else "ERROR"
    print(
        f"[includes] {verdict}: {len(torch_tus)} of {len(tus)} CPU-build translation units include "
        f"torch headers (at most {MAX_TORCH_TUS})"
    )
    if "--list" in argv or len(torch_tus) > MAX_TORCH_TUS:
        for tu, first in torch_tus:
            print(f"[includes]   {rel(tu)} (<{first}>, ...)")
    if len(torch_tus) > MAX_TORCH_TUS:
        rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
