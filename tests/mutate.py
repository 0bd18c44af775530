"""Mutation testing of the learning-critical modules: break the code in small ways, see which tests notice.

    python tests/mutate.py                      # a seeded sample of mutants per module, a few minutes
    python tests/mutate.py --per-module 0       # every mutant (long)
    python tests/mutate.py --modules trainer/loss store/ledger --json runs/mutate.json

Each mutant changes one operator in one module (+ and -, * and /, < and <=, > and >=, == and !=,
`and` and `or`, `not x` to `x`, 0 and 1, True and False), is written into a copy of the
repository (git's tracked files, in a temporary directory: the checkout is never touched), and
the module's own test files run against it (`pytest -x -q`, -m "not gpu"). A mutant the tests
pass is a survivor: printed with its line, so a test can be written that fails on it. The copy
is deleted at the end, whatever happens.
"""

from __future__ import annotations

import argparse
import ast
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

# module (under pipeline/) -> the test files that own it (the audit's scope: where a silent break corrupts learning)
TARGETS = {
    "trainer/loss": ["tests/trainer/test_loss.py", "tests/trainer/test_trainer_learning.py"],
    "loop/buffer": ["tests/loop/test_buffer.py"],
    "loop/scoring": ["tests/loop/test_scoring.py", "tests/data/test_rewards.py", "tests/loop/test_episodes.py",
                     "tests/loop/test_version_guard.py"],
    "loop/training": ["tests/loop/test_training.py", "tests/loop/test_orchestrator.py",
                      "tests/loop/test_checkpoints_behind.py", "tests/trainer/test_full_weights.py"],
    # what a checkpoint holds of the trainer: a wrong byte there resumes a different policy
    "trainer/state": ["tests/trainer/test_trainer.py", "tests/trainer/test_trainer_full.py",
                      "tests/loop/test_checkpoints_behind.py"],
    "trainer/policy": ["tests/trainer/test_trainer.py", "tests/trainer/test_trainer_learning.py",
                       "tests/trainer/test_trainer_full.py"],
    # the trainer split's parts of a step: the rows and micro-batches, and the LoRA / full-weight update
    "trainer/rows": ["tests/trainer/test_trainer_learning.py", "tests/trainer/test_trainer_mask.py",
                     "tests/trainer/test_trainer.py"],
    "trainer/update": ["tests/trainer/test_trainer.py", "tests/trainer/test_trainer_full.py"],
    # the one owner of a group's life: its exits into the ledger and the rollout log
    "loop/outcomes": ["tests/loop/test_outcomes.py", "tests/loop/test_orchestrator.py"],
    "loop/episodes": ["tests/loop/test_episodes.py"],
    "store/ledger": ["tests/store/test_ledger.py"],
    # the checks between a published version and an engine: a wrong one serves corrupt weights
    "store/weights": ["tests/store/test_adapter_store.py"],
    "engines/shared_weights": ["tests/engines/test_shared_weights.py"],
}

_SWAPS: dict[type, type] = {
    ast.Add: ast.Sub, ast.Sub: ast.Add, ast.Mult: ast.Div, ast.Div: ast.Mult,
    ast.Lt: ast.LtE, ast.LtE: ast.Lt, ast.Gt: ast.GtE, ast.GtE: ast.Gt, ast.Eq: ast.NotEq, ast.NotEq: ast.Eq,
    ast.And: ast.Or, ast.Or: ast.And,
}


@dataclass(frozen=True)
class Mutant:
    module: str
    index: int  # which mutable site, in the module's walk order
    line: int
    what: str


def _sites(tree: ast.AST) -> list[tuple[ast.AST, str, str]]:
    """(node, field, description) of every mutable spot, in a fixed order."""
    out: list[tuple[ast.AST, str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.BinOp, ast.BoolOp)) and type(node.op) in _SWAPS:
            out.append((node, "op", f"{type(node.op).__name__} -> {_SWAPS[type(node.op)].__name__}"))
        elif isinstance(node, ast.Compare):
            for i, op in enumerate(node.ops):
                if type(op) in _SWAPS:
                    out.append((node, f"ops.{i}", f"{type(op).__name__} -> {_SWAPS[type(op)].__name__}"))
        elif isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.Not):
            out.append((node, "not", "not x -> x"))
        elif isinstance(node, ast.Constant) and type(node.value) in (int, bool) and node.value in (0, 1):
            out.append((node, "value", f"{node.value!r} -> {_flip(node.value)!r}"))
    return out


def _flip(v: int | bool) -> int | bool:
    return (not v) if isinstance(v, bool) else 1 - v


class _NotRemover(ast.NodeTransformer):
    def __init__(self, target: ast.AST) -> None:
        self.target = target

    def visit_UnaryOp(self, node: ast.UnaryOp) -> ast.AST:
        return node.operand if node is self.target else self.generic_visit(node)


def mutated_source(source: str, index: int) -> str:
    """The module's source with mutable site `index` changed."""
    tree = ast.parse(source)
    node, field, _ = _sites(tree)[index]
    if field == "op":
        node.op = _SWAPS[type(node.op)]()
    elif field.startswith("ops."):
        i = int(field.split(".")[1])
        node.ops[i] = _SWAPS[type(node.ops[i])]()
    elif field == "not":
        tree = _NotRemover(node).visit(tree)
    else:
        node.value = _flip(node.value)
    return ast.unparse(ast.fix_missing_locations(tree))


def mutants(module: str, per_module: int, seed: int) -> list[Mutant]:
    source = (REPO / "pipeline" / f"{module}.py").read_text()
    tree = ast.parse(source)
    # docstrings' and annotations' constants are not code that runs: leave them out
    skip = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    found = [Mutant(module, i, getattr(node, "lineno", 0), what) for i, (node, _, what) in enumerate(_sites(tree))
             if id(node) not in skip]
    if per_module and len(found) > per_module:
        found = sorted(random.Random(f"{seed}-{module.rsplit('/', 1)[-1]}").sample(found, per_module), key=lambda m: m.index)
    return found


def _copy_repo(dest: Path) -> None:
    files = subprocess.run(["git", "ls-files", "-z"], cwd=REPO, capture_output=True, check=True).stdout.split(b"\0")
    for name in filter(None, files):
        src = REPO / name.decode()
        if src.is_file():
            (dest / name.decode()).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name.decode())


def run_tests(copy: Path, tests: list[str], timeout: float) -> str:
    """"killed" (a test failed or errored), "survived" (they passed) or "timeout"."""
    env = {**os.environ, "PYTHONPATH": str(copy) + os.pathsep + os.environ.get("PYTHONPATH", ""),
           "PYTHONDONTWRITEBYTECODE": "1"}
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", "-m", "not gpu",
                               *tests], cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "timeout"  # a mutant that makes a test hang is caught too (by the clock)
    return "survived" if proc.returncode == 0 else "killed"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modules", nargs="+", default=list(TARGETS), choices=list(TARGETS))
    p.add_argument("--per-module", type=int, default=6, help="mutants sampled per module (0 = all)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=300, help="seconds a mutant's tests may take")
    p.add_argument("--json", help="write every mutant's outcome here")
    args = p.parse_args(argv)
    results = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mutate-") as tmp:
        copy = Path(tmp)
        _copy_repo(copy)
        for module in args.modules:
            tests = [t for t in TARGETS[module] if (copy / t).is_file()]
            original = (copy / "pipeline" / f"{module}.py").read_text()
            if run_tests(copy, tests, args.timeout) != "survived":
                print(f"{module}: its tests fail without a mutation; fix them first", flush=True)
                return 2
            for m in mutants(module, args.per_module, args.seed):
                (copy / "pipeline" / f"{module}.py").write_text(mutated_source(original, m.index))
                outcome = run_tests(copy, tests, args.timeout)
                (copy / "pipeline" / f"{module}.py").write_text(original)
                results.append({**asdict(m), "outcome": outcome})
                mark = "SURVIVED" if outcome == "survived" else outcome
                print(f"{module}.py:{m.line:<4} {m.what:<22} {mark}", flush=True)
    survivors = [r for r in results if r["outcome"] == "survived"]
    print(f"\n{len(survivors)} of {len(results)} mutants survived ({time.monotonic() - t0:.0f} s)")
    for r in survivors:
        print(f"  pipeline/{r['module']}.py:{r['line']}  {r['what']}")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps({"seed": args.seed, "per_module": args.per_module,
                                               "results": results}, indent=1))
    return 1 if survivors else 0


if __name__ == "__main__":
    raise SystemExit(main())
