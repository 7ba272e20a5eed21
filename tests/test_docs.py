"""The repository stands alone: its documents link only to files it contains, and the README
says how to get the torch build a machine needs."""

import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _tracked_text_files() -> list[Path]:
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True,
                           check=True).stdout.split()
    return [ROOT / n for n in names if n.endswith((".py", ".md", ".cfg", ".toml", ".json", ".txt"))]


def test_nothing_points_outside_the_repository():
    outside = "../" + "shared"  # spelled apart so that this file is not an offender itself
    offenders = [str(p.relative_to(ROOT)) for p in _tracked_text_files()
                 if p.exists() and outside in p.read_text(encoding="utf-8")]
    assert not offenders


def test_design_and_benchmark_documents_are_linked_and_exist():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "(docs/DESIGN.md)" in readme and "(docs/BENCHMARKS.md)" in readme
    assert "(docs/USAGE.md)" in readme
    for doc in (ROOT / "README.md", *(ROOT / "docs").glob("*.md")):
        for target in re.findall(r"\]\(([^)#:]+)\)", doc.read_text(encoding="utf-8")):
            assert (doc.parent / target).exists(), f"{doc.name} links to missing {target}"
    benchmarks = "".join(p.read_text() for p in (ROOT / "benchmarks").glob("*.py"))
    assert "docs/BENCHMARKS.md" in benchmarks


def test_readme_keeps_the_ci_lines_and_explains_torch_builds():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    ci = (ROOT / ".ci" / "run").read_text()
    assert "pip install torch==2.13.0 && pip install -e '.[test]' && pytest" in readme
    assert "pip install --quiet torch==2.13.0" in ci and "-e '.[test]'" in ci
    section = readme.split("### Installing torch", 1)[1].split("\n## ", 1)[0]
    assert "**CPU only**" in section and "**CUDA**" in section
    assert "needs no particular build" in section


def test_readme_is_short():
    """The README says what rtpkv is and how to start; the manual lives in docs/USAGE.md."""
    assert len((ROOT / "README.md").read_bytes()) < 12 * 1024


def test_design_layout_names_every_module():
    """docs/DESIGN.md's layout lists every module of the package by its file name."""
    design = (ROOT / "docs" / "DESIGN.md").read_text(encoding="utf-8")
    layout = design[design.index("## Layout"):]
    layout = layout[:layout.index("\n## ", 10)]
    files = [p for folder in ("rtpkv", "model_factory", "tasks", "kernels")
             for pattern in ("*.py", "*.c", "*.h") for p in (ROOT / folder).rglob(pattern)
             if p.name != "__init__.py" or folder == "kernels"]
    assert [str(p.relative_to(ROOT)) for p in files if p.name not in layout] == []
