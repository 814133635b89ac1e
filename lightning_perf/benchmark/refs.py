"""Git refs of the user's project side by side: a temporary worktree per ref, that tree first on the import path.

:func:`ref_checkout` checks a ref out with ``git worktree add --detach`` into a temporary directory and removes it
afterwards (``git worktree remove --force`` and ``git worktree prune``), also when the work inside fails or is
interrupted. :func:`working_tree` describes the current working tree, which is benchmarked as it is, dirty or not.
A :class:`Checkout` says how to run a command in its tree: the working directory and ``PYTHONPATH`` (that tree first,
so the user's modules import from it) and where a file of the project lies in it.

The repository is the one containing the current working directory. This module imports no torch and no Lightning.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from lightning_perf.benchmark.tasks import WORKING_TREE

__all__ = [
    "WORKING_TREE",
    "Checkout",
    "GitRefError",
    "file_label",
    "ref_checkout",
    "repository_root",
    "resolve_ref",
    "working_tree",
]

_GIT_TIMEOUT_S = 300.0  # a worktree checkout of a large repository takes a while; a hung git must not hang us


class GitRefError(ValueError):
    """A ref that cannot be used: no repository, no git, or no such commit (one-line message)."""


def _git(repo: Path | str, *args: str) -> subprocess.CompletedProcess[str]:
    try:
        return subprocess.run(
            ["git", "-C", str(repo), *args],
            capture_output=True,
            text=True,
            timeout=_GIT_TIMEOUT_S,
            check=False,
            stdin=subprocess.DEVNULL,
        )
    except FileNotFoundError:
        raise GitRefError("git is not installed (needed to benchmark git refs)") from None


def _last_line(text: str) -> str:
    lines = [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1] if lines else ""


def repository_root(cwd: str | Path | None = None) -> Path | None:
    """The top directory of the git repository containing ``cwd`` (default: the working directory), or None."""
    try:
        done = _git(Path(cwd or os.getcwd()), "rev-parse", "--show-toplevel")
    except GitRefError:
        return None
    return Path(done.stdout.strip()).resolve() if done.returncode == 0 and done.stdout.strip() else None


def resolve_ref(ref: str, repo: str | Path) -> str:
    """The full commit hash ``ref`` names in ``repo``.

    Raises:
        GitRefError: naming the ref when it names no commit.
    """
    if not ref or ref.startswith("-"):
        raise GitRefError(f"{ref!r} is not valid. Expected a branch, tag or commit of the repository at {repo}")
    done = _git(repo, "rev-parse", "--verify", "--quiet", "--end-of-options", f"{ref}^{{commit}}")
    if done.returncode != 0 or not done.stdout.strip():
        raise GitRefError(
            f"{ref!r} is not valid. Expected a branch, tag or commit of the repository at {repo} (git knows no such "
            "commit)"
        )
    return done.stdout.strip()


def is_dirty(repo: str | Path, exclude: Sequence[str | Path] = ()) -> bool:
    """Whether ``git status --porcelain`` lists anything (untracked files included), leaving out ``exclude``.

    ``exclude`` holds paths whose changes do not count: the bench's own output directory, so that a second run does
    not call the tree dirty because of the first run's results.
    """
    root = Path(repo).resolve()
    specs = ["."]
    for path in exclude:
        with contextlib.suppress(ValueError):
            relative = Path(path).resolve().relative_to(root)
            if relative.parts:
                specs.append(f":(exclude){relative.as_posix()}")
    done = _git(root, "status", "--porcelain", "--", *specs)
    return done.returncode == 0 and bool(done.stdout.strip())


@dataclass(frozen=True)
class Checkout:
    """A tree of the user's project to run a task in: a git ref's temporary worktree, or the working tree.

    Attributes:
        ref: the ref as given (``"."`` for the working tree).
        commit: the full commit hash (for the working tree: HEAD's, None outside a repository).
        root: the top of the tree to run in (the worktree, or the repository's top directory).
        repo: the top directory of the user's repository (None outside one).
        dirty: the working tree has changes (always False for a ref).
    """

    ref: str
    commit: str | None
    root: Path
    repo: Path | None
    dirty: bool = False

    @property
    def is_working_tree(self) -> bool:
        return self.ref == WORKING_TREE

    @property
    def short_commit(self) -> str | None:
        return self.commit[:7] if self.commit else None

    @property
    def label(self) -> str:
        """``main (1a2b3c4)``, ``working tree (1a2b3c4)``, ``working tree (dirty)`` or ``working tree``."""
        if not self.is_working_tree:
            return f"{self.ref} ({self.short_commit})"
        if self.dirty:
            return "working tree (dirty)"
        return f"working tree ({self.short_commit})" if self.commit else "working tree"

    def path_for(self, path: str | Path) -> Path:
        """Where ``path`` (a file of the working tree) lies in this tree; a path outside the repository as is."""
        path = Path(path).absolute()
        if self.repo is None or self.is_working_tree:
            return path
        try:
            return self.root / path.resolve().relative_to(self.repo)
        except ValueError:
            return path

    def cwd(self, cwd: str | Path | None = None) -> Path:
        """The directory to run in: ``cwd`` (default: the current one) mapped into this tree when it exists there."""
        here = Path(cwd or os.getcwd()).absolute()
        mapped = self.path_for(here)
        return mapped if mapped.is_dir() else self.root

    def env(self, base: Mapping[str, str] | None = None, cwd: str | Path | None = None) -> dict[str, str]:
        """``base`` (default: this process's environment) with this tree first on ``PYTHONPATH``.

        First the run's directory (:meth:`cwd`), then the tree's top when they differ, then the old ``PYTHONPATH``:
        ``package.module:Class`` names the user's modules as they are in this tree.
        """
        env = dict(os.environ if base is None else base)
        first = [str(self.cwd(cwd))]
        if str(self.root) not in first:
            first.append(str(self.root))
        rest = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p and p not in first]
        env["PYTHONPATH"] = os.pathsep.join(first + rest)
        return env


def working_tree(cwd: str | Path | None = None, exclude: Sequence[str | Path] = ()) -> Checkout:
    """The current working tree as it is: HEAD's commit and whether it is dirty (see :func:`is_dirty`)."""
    here = Path(cwd or os.getcwd()).absolute()
    repo = repository_root(here)
    if repo is None:
        return Checkout(WORKING_TREE, None, here, None, False)
    done = _git(repo, "rev-parse", "--verify", "--quiet", "HEAD")
    commit = done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else None
    return Checkout(WORKING_TREE, commit, repo, repo, is_dirty(repo, exclude))


@contextlib.contextmanager
def ref_checkout(ref: str, cwd: str | Path | None = None, commit: str | None = None) -> Iterator[Checkout]:
    """Check ``ref`` out in a temporary worktree of the repository containing ``cwd``; yield its :class:`Checkout`.

    ``"."`` yields the working tree itself (nothing is checked out). The worktree is detached (no branch is moved)
    and removed on exit, whatever the exit: normal, an exception or ``KeyboardInterrupt``.

    Args:
        ref: a branch, tag or commit.
        cwd: a directory inside the repository (default: the working directory).
        commit: the commit ``ref`` resolved to, when the caller resolved it already (all refs are checked before
            any work starts).

    Raises:
        GitRefError: no repository, no git, no such ref, or ``git worktree add`` failed (its last line).
    """
    if ref == WORKING_TREE:
        yield working_tree(cwd)
        return
    here = Path(cwd or os.getcwd()).absolute()
    repo = repository_root(here)
    if repo is None:
        raise GitRefError(f"{str(here)!r} is not inside a git repository (needed to benchmark the ref {ref!r})")
    commit = commit or resolve_ref(ref, repo)
    holder = Path(tempfile.mkdtemp(prefix=f"lightning-perf-{file_label(ref)[:40]}-"))
    tree = holder / repo.name
    try:
        done = _git(repo, "worktree", "add", "--detach", str(tree), commit)
        if done.returncode != 0:
            raise GitRefError(f"git worktree add for {ref!r} failed: {_last_line(done.stderr) or done.returncode}")
        yield Checkout(ref, commit, tree.resolve(), repo, False)
    finally:
        _git(repo, "worktree", "remove", "--force", str(tree))
        _git(repo, "worktree", "prune")
        shutil.rmtree(holder, ignore_errors=True)


def file_label(ref: str) -> str:
    """A file-name-safe form of a ref: ``feature/x`` gives ``feature-x``, ``.`` gives ``working-tree``."""
    if ref == WORKING_TREE:
        return "working-tree"
    return re.sub(r"[^A-Za-z0-9._-]+", "-", ref).strip("-.") or "ref"
