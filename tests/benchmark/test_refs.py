"""Git refs side by side: a temporary worktree per ref, first on the import path, removed on every exit."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from lightning_perf.benchmark.refs import (
    WORKING_TREE,
    GitRefError,
    file_label,
    ref_checkout,
    repository_root,
    resolve_ref,
    working_tree,
)

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(repo: Path, *args: str) -> str:
    config = ["-c", "user.name=t", "-c", "user.email=t@example.invalid", "-c", "commit.gpgsign=false"]
    done = subprocess.run(["git", *config, *args], cwd=repo, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def make_project(root: Path) -> dict[str, str]:
    """A user project with two commits: ``userpkg.constants.FACTOR`` is 1 at tag v1 and 2 at tag v2."""
    root.mkdir()
    git(root, "init", "-q")
    (root / "userpkg").mkdir()
    (root / "userpkg" / "__init__.py").write_text("")
    (root / "configs").mkdir()
    (root / "configs" / "cli.yaml").write_text("factor: 1\n")
    for factor in (1, 2):
        (root / "userpkg" / "constants.py").write_text(f"FACTOR = {factor}\n")
        (root / "configs" / "cli.yaml").write_text(f"factor: {factor}\n")
        git(root, "add", "-A")
        git(root, "commit", "-q", "-m", f"factor {factor}")
        git(root, "tag", f"v{factor}")
    return {"v1": git(root, "rev-parse", "v1"), "v2": git(root, "rev-parse", "v2")}


@pytest.fixture
def project(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    root = tmp_path / "project"
    return root, make_project(root)


def worktrees(repo: Path) -> list[str]:
    return [line for line in git(repo, "worktree", "list", "--porcelain").splitlines() if line.startswith("worktree ")]


def factor_in(checkout_env: dict[str, str], cwd: Path) -> tuple[str, str]:
    code = "import userpkg.constants as c; print(c.FACTOR, c.__file__)"
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=checkout_env, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    value, where = done.stdout.split()
    return value, where


def test_resolve_ref(project: tuple[Path, dict[str, str]]) -> None:
    root, commits = project
    assert resolve_ref("v1", root) == commits["v1"]
    assert resolve_ref("HEAD~1", root) == commits["v1"]
    assert resolve_ref(commits["v2"][:8], root) == commits["v2"]
    for bad in ("nope", "v3", "--all", ""):
        with pytest.raises(GitRefError, match=r"is not valid\. Expected a branch, tag or commit"):
            resolve_ref(bad, root)
    assert repository_root(root / "userpkg") == root.resolve()
    assert repository_root(root.parent) is None


def test_a_ref_is_checked_out_first_on_the_import_path_and_removed(project: tuple[Path, dict[str, str]]) -> None:
    root, commits = project
    with ref_checkout("v1", cwd=root / "configs") as checkout:
        tree = checkout.root
        assert checkout.commit == commits["v1"] and checkout.label == f"v1 ({commits['v1'][:7]})"
        assert (tree / "userpkg" / "constants.py").read_text() == "FACTOR = 1\n"
        assert len(worktrees(root)) == 2
        # a file of the project, and the directory the command was started in, map into the worktree
        assert checkout.path_for(root / "configs" / "cli.yaml").read_text() == "factor: 1\n"
        assert checkout.path_for("/elsewhere/x.yaml") == Path("/elsewhere/x.yaml")
        assert checkout.cwd(root / "configs") == tree / "configs"
        env = checkout.env({"PYTHONPATH": "/old"}, cwd=root)
        assert env["PYTHONPATH"].split(":") == [str(tree), "/old"]
        value, where = factor_in(checkout.env(cwd=root), cwd=Path("/"))
        assert value == "1" and where.startswith(str(tree))
    assert not tree.exists() and not tree.parent.exists()
    assert len(worktrees(root)) == 1
    git(root, "worktree", "prune")  # nothing left to prune: the worktree was unregistered too
    assert len(worktrees(root)) == 1


@pytest.mark.parametrize("raised", [RuntimeError, KeyboardInterrupt])
def test_the_worktree_is_removed_when_the_work_fails(
    project: tuple[Path, dict[str, str]], raised: type[BaseException]
) -> None:
    root, _ = project
    with pytest.raises(raised), ref_checkout("v2", cwd=root) as checkout:
        tree = checkout.root
        assert tree.is_dir()
        raise raised("step 3")
    assert not tree.exists() and len(worktrees(root)) == 1


def test_a_missing_ref_or_no_repository_is_an_error(project: tuple[Path, dict[str, str]], tmp_path: Path) -> None:
    root, _ = project
    with pytest.raises(GitRefError, match="'nope' is not valid"), ref_checkout("nope", cwd=root):
        pass
    outside = tmp_path / "plain"
    outside.mkdir()
    with pytest.raises(GitRefError, match="is not inside a git repository"), ref_checkout("v1", cwd=outside):
        pass
    assert len(worktrees(root)) == 1


def test_the_working_tree_as_it_is_clean_or_dirty(project: tuple[Path, dict[str, str]]) -> None:
    root, commits = project
    clean = working_tree(root)
    assert (clean.commit, clean.dirty, clean.is_working_tree) == (commits["v2"], False, True)
    assert clean.label == f"working tree ({commits['v2'][:7]})"
    assert clean.path_for(root / "configs" / "cli.yaml") == root / "configs" / "cli.yaml"
    # results written under the output directory do not make the tree dirty; anything else does
    (root / "bench-results").mkdir()
    (root / "bench-results" / "t.json").write_text("{}")
    assert working_tree(root, exclude=[root / "bench-results"]).dirty is False
    assert working_tree(root).dirty is True
    shutil.rmtree(root / "bench-results")
    (root / "userpkg" / "constants.py").write_text("FACTOR = 3\n")
    dirty = working_tree(root)
    assert dirty.dirty and dirty.label == "working tree (dirty)"
    value, _ = factor_in(dirty.env(cwd=root), cwd=root)
    assert value == "3"  # benchmarked as it is
    with ref_checkout(WORKING_TREE, cwd=root) as checkout:
        assert checkout.root == root.resolve() and checkout.dirty
    assert len(worktrees(root)) == 1


def test_outside_a_repository_the_working_tree_has_no_commit(tmp_path: Path) -> None:
    checkout = working_tree(tmp_path)
    assert (checkout.commit, checkout.repo, checkout.label) == (None, None, "working tree")


def test_file_labels() -> None:
    labels = [file_label(r) for r in (".", "main", "feature/x y", "v1.2", "~^")]
    assert labels == ["working-tree", "main", "feature-x-y", "v1.2", "ref"]
