#!/usr/bin/env python3
"""Project rules for .github/workflows/*.yml, beyond the GitHub schema (run by `nox -s lint`).

* every job that runs commands runs them through nox (`nox -s ...`), so CI and release do
  exactly what a developer runs locally; publish jobs only download and upload;
* every `uses:` action is pinned to a version (`@v4`, `@release/v1` or a commit);
* release.yml: triggered by tags `<distribution>-v<X.Y.Z>`; the publish jobs are gated by
  the environments `testpypi` then `pypi` (PyPI needs TestPyPI), hold `id-token: write`
  (OIDC trusted publishing) and never build; no other job holds `id-token: write`.

Usage: check_workflows.py FILE...; exit status 1 on any violation.
"""

from __future__ import annotations

import sys
from pathlib import Path

import yaml

PUBLISH_ACTION = "pypa/gh-action-pypi-publish"


def _on(doc: dict) -> dict:
    # YAML 1.1 reads the bare key `on` as True.
    return doc.get("on", doc.get(True, {})) or {}


def check_file(path: Path) -> list[str]:
    errors: list[str] = []
    doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    jobs: dict = doc.get("jobs", {})
    for job_id, job in jobs.items():
        steps = job.get("steps", [])
        runs = [s["run"] for s in steps if "run" in s]
        publishes = any(str(s.get("uses", "")).startswith(PUBLISH_ACTION) for s in steps)
        for step in steps:
            uses = step.get("uses")
            if uses and "@" not in uses:
                errors.append(f"{path}: job {job_id}: action {uses} is not pinned to a version")
        if runs and not publishes and not any("nox -s" in r for r in runs):
            errors.append(f"{path}: job {job_id} runs commands but no `nox -s` session")
        perms = job.get("permissions", {}) or {}
        if publishes:
            if perms.get("id-token") != "write":
                errors.append(f"{path}: job {job_id} publishes without `id-token: write` (OIDC)")
            if any("-m build" in r or "nox -s build" in r for r in runs):
                errors.append(f"{path}: job {job_id} publishes and builds; build in its own job")
        elif perms.get("id-token") == "write":
            errors.append(f"{path}: job {job_id} holds id-token: write but does not publish")
    if path.name == "release.yml":
        tags = (_on(doc).get("push") or {}).get("tags", [])
        if not tags or not all("-v" in t for t in tags):
            errors.append(f"{path}: must trigger on tags '<distribution>-v<X.Y.Z>', found {tags}")
        envs = {}
        for job_id, job in jobs.items():
            env = job.get("environment")
            name = env.get("name") if isinstance(env, dict) else env
            if any(str(s.get("uses", "")).startswith(PUBLISH_ACTION) for s in job.get("steps", [])):
                envs[name] = job_id
        if set(envs) != {"testpypi", "pypi"}:
            errors.append(f"{path}: publish jobs must use environments testpypi and pypi: {envs}")
        elif envs["testpypi"] not in _needs(jobs[envs["pypi"]]):
            errors.append(f"{path}: the pypi job must need the testpypi job")
    return errors


def _needs(job: dict) -> list[str]:
    needs = job.get("needs", [])
    return [needs] if isinstance(needs, str) else list(needs)


def main(argv: list[str]) -> int:
    if not argv:
        print("usage: check_workflows.py FILE...", file=sys.stderr)
        return 2
    errors = [e for f in argv for e in check_file(Path(f))]
    for error in errors:
        print(f"error: {error}", file=sys.stderr)
    if not errors:
        print(f"check_workflows: {len(argv)} workflow(s) follow the project rules")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
