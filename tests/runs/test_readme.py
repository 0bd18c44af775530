"""What README.md and docs/ promise that code can check: the embedding example runs, the test command
is CI's, the config reference is current, and every relative link points at something."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text(encoding="utf-8")
CONFIGURATION = ROOT / "docs" / "configuration.md"


def test_the_embedding_example_runs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys) -> None:
    block = README.split("<!-- embed-example", 1)[1]
    code = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    assert "pipeline.steps=20" in code and 'out="runs/embedded"' in code
    code = code.replace("pipeline.steps=20", "pipeline.steps=2").replace(
        'out="runs/embedded"', f'out="{tmp_path / "run"}"')
    monkeypatch.chdir(tmp_path)  # the built-in model cache goes here, not into the checkout
    exec(compile(code, "README.md", "exec"), {"__name__": "readme_example"})
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1] == "True"  # pipe.summary["accounting_ok"]
    assert [line.split()[0] for line in out[:-1]] == ["1", "2"]


@pytest.mark.slow
def test_the_embedding_example_runs_as_a_script_without_a_main_guard(tmp_path: Path) -> None:
    # `python example.py`: the trainer's process must not import the script again (a spawned
    # child that re-ran it built a second pipeline in the same run directory)
    block = README.split("<!-- embed-example", 1)[1]
    code = re.search(r"```python\n(.*?)```", block, re.S).group(1)
    assert "__main__" not in code and "pipeline.steps=20" in code
    script = tmp_path / "example.py"
    script.write_text(code.replace("pipeline.steps=20", "pipeline.steps=2"), encoding="utf-8")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = proc.stdout.strip().splitlines()
    assert out[-1] == "True", proc.stdout  # pipe.summary["accounting_ok"]
    assert [line.split()[0] for line in out[:-1]] == ["1", "2"]


def test_readme_test_command_is_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text()
    command = 'python -m pytest -m "not gpu" -q'
    assert command in README and command in ci


def test_the_config_reference_is_current() -> None:
    from pipeline.config.io import reference_markdown

    # the page is a short intro followed by exactly what `python -m pipeline.config` prints
    assert CONFIGURATION.read_text(encoding="utf-8").rstrip().endswith(reference_markdown().strip()), (
        "docs/configuration.md is stale: replace its tables with the output of `python -m pipeline.config`")


def _slug(heading: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _without_code_blocks(text: str) -> str:
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


@pytest.mark.parametrize("page", ["README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md"))])
def test_relative_links_point_at_something(page: str) -> None:
    path = ROOT / page
    text = _without_code_blocks(path.read_text(encoding="utf-8"))
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert links or page == "docs/configuration.md"  # only the generated reference links nowhere
    for link in links:
        if re.match(r"[a-z]+:", link):  # http:, https:, mailto: are not checked offline
            continue
        target, _, anchor = link.partition("#")
        dest = (path.parent / target).resolve() if target else path
        assert dest.exists(), f"{page}: link {link!r} points at nothing"
        if anchor:
            headings = re.findall(r"^#+ (.+)$", _without_code_blocks(dest.read_text(encoding="utf-8")), re.M)
            assert anchor in {_slug(h) for h in headings}, f"{page}: no heading for #{anchor} in {target or page}"


def test_every_config_section_is_introduced_by_a_whole_sentence() -> None:
    """A section's docstring of several lines once reached the page cut after its first line."""
    from pipeline.config.io import reference_markdown

    heads = [line for line in reference_markdown().splitlines() if line.startswith("**")]
    assert len(heads) > 10
    for line in heads:
        text = line.split("** ", 1)[1]
        assert text.endswith(".") and not text.startswith("["), line
