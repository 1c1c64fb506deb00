"""How peftx reads and writes files. Text files (TOML, JSON) are read whole, checked to be
regular UTF-8 files, and their errors name the file. Files are written under temporary
names, moved into place whole, with the user's umask, never deleting what peftx did not
write.

A save of several files (a sharded checkpoint, an adapter's config and weights, a
fine-tuning run) is written into a new directory beside its target, and that directory
replaces the target in one rename. On Linux the swap is `renameat2(RENAME_EXCHANGE)`, so a
process killed at any point leaves either the old directory or the new one at the target,
never a mix. Entries of the old directory that the save does not write are carried into
the new one as hard links, so the user's own files survive the swap. A target that is a
symbolic link is followed: the directory it names is replaced, and the link stays.
"""

import contextlib
import ctypes
import errno
import glob
import json
import os
import re
import shutil
import tempfile
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from ._errors import ConfigFileError, DiskFullError

TMP_SUFFIX = ".peftx-tmp"
# `.{target}.peftx-{new|old}-{pid}-{random}`: beside a directory being replaced
_SIBLING = re.compile(r"\.(?P<target>.+)\.peftx-(?P<kind>new|old)-(?P<pid>\d+)-[^.]+")


def _umask() -> int:
    try:  # Linux: read it without changing it (os.umask would race with other threads)
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def file_mode() -> int:
    """The mode of a new regular file under the current umask (as `open` would create)."""
    return 0o666 & ~_umask()


def dir_mode() -> int:
    """The mode of a new directory under the current umask (as `mkdir` would create)."""
    return 0o777 & ~_umask()


def temporary_file(target: Path) -> str:
    """A new empty file beside `target` with a name peftx recognizes as its own temporary
    (`.{name}.<random>.peftx-tmp`), with the umask's mode (`mkstemp` would give 0600)."""
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=f".{target.name}.", suffix=TMP_SUFFIX)
    os.fchmod(fd, file_mode())
    os.close(fd)
    return tmp


def write_text(path: Path, text: str) -> None:
    """Write `path` whole or not at all: a temporary file renamed onto it."""
    tmp = temporary_file(path)
    try:
        with naming_a_full_disk(path, len(text.encode())):
            Path(tmp).write_text(text, encoding="utf-8")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def copy_file(source: Path, target: Path) -> None:
    """Copy `source` to `target` whole or not at all (a temporary copy renamed onto it)."""
    tmp = temporary_file(target)
    try:
        with naming_a_full_disk(target, source.stat().st_size):
            shutil.copyfile(source, tmp)
        os.replace(tmp, target)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _is_disk_full(error: BaseException) -> bool:
    """An error of a write that found no space (or no quota) left: an `OSError`, or the
    `SafetensorError` that wraps the same error of the Rust writer."""
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    return type(error).__name__ == "SafetensorError" and (
        re.search(rf"\bcode: ({errno.ENOSPC}|{errno.EDQUOT})\b", str(error)) is not None
    )


@contextlib.contextmanager
def naming_a_full_disk(path: Path, size: int) -> Iterator[None]:
    """Turn a full disk met by the block, which writes `path` (about `size` bytes), into a
    one-line `DiskFullError` naming `path`, the bytes it needs and the bytes free."""
    try:
        yield
    except Exception as e:
        if not _is_disk_full(e):
            raise
        try:
            free = f"{shutil.disk_usage(path.parent).free:,} bytes are free there"
        except OSError:
            free = "its file system's free space is unknown"
        raise DiskFullError(
            e.errno if isinstance(e, OSError) else errno.ENOSPC,
            f"no space left on the device to write {str(path)!r}: it needs about "
            f"{size:,} bytes and {free}; free some space and run it again",
        ) from None


def remove_leftovers(directory: Path) -> list[Path]:
    """Delete what killed writes of peftx left under `directory`: its temporary files
    (`*.peftx-tmp`) and the unfinished directories of replacements whose process is gone.
    Returns them."""
    return [p for p in sorted(Path(directory).rglob(".*")) if p.exists() and _tidy(p)]


def _tidy(path: Path) -> bool:
    """Delete `path` if it is a leftover of a killed write (see `remove_leftovers`), or put
    it back where the fallback swap was cut between its two renames; True if deleted."""
    if path.name.endswith(TMP_SUFFIX) and path.is_file():
        path.unlink(missing_ok=True)
        return True
    m = _SIBLING.fullmatch(path.name)
    if m is None or path.is_symlink() or not path.is_dir() or _alive(int(m["pid"])):
        return False
    target = path.parent / m["target"]
    if m["kind"] == "old" and not target.exists():
        os.rename(path, target)
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def _alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _sibling(target: Path, kind: str) -> Path:
    return Path(
        tempfile.mkdtemp(prefix=f".{target.name}.peftx-{kind}-{os.getpid()}-", dir=target.parent)
    )


def _recover(target: Path) -> None:
    """Tidy what earlier replacements of `target`, killed part-way, left beside it."""
    if target.parent.is_dir():
        for p in target.parent.glob(f".{glob.escape(target.name)}.peftx-*"):
            _tidy(p)


_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap two paths in one atomic step (Linux `renameat2`); False where unsupported."""
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (AttributeError, OSError):
        return False
    renameat2.argtypes = [
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_int,
        ctypes.c_char_p,
        ctypes.c_uint,
    ]
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), str(b))


def _carry_over(old: Path, new: Path, drop: Callable[[Path], bool]) -> None:
    """Hard-link into `new` each entry of `old` that `new` lacks and `drop` does not claim
    (recursing into directories both have), so swapping `new` in keeps them."""
    for entry in old.iterdir():
        there = new / entry.name
        if drop(entry):
            continue
        if entry.is_dir() and not entry.is_symlink():
            if not there.exists():
                shutil.copytree(entry, there, symlinks=True, copy_function=_link_or_copy)
            elif there.is_dir():
                _carry_over(entry, there, drop)
        elif not there.exists() and not there.is_symlink():
            if entry.is_symlink():
                os.symlink(os.readlink(entry), there)
            else:
                _link_or_copy(entry, there)


def _link_or_copy(src: str | Path, dst: str | Path) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a file system without hard links
        shutil.copy2(src, dst)


def followed(path: Path) -> Path:
    """`path`, or where it leads if it is a symbolic link: the directory a save replaces
    (replacing the link itself would put the new directory in its place and leave the old
    one behind a link beside it)."""
    return Path(os.path.realpath(path)) if path.is_symlink() else path


def swap_in(new: Path, target: Path, *, drop: Callable[[Path], bool] = lambda p: False) -> None:
    """Make the directory `new` (a sibling of `target`) the directory at `target`, keeping
    the entries of an existing `target` that `new` lacks unless `drop(entry)`. `target`
    may not be a symbolic link (see `followed`).

    A kill at any point leaves `target` as the old or the new directory; leftovers beside
    it are tidied by the next replacement of `target`."""
    if target.is_symlink():
        raise IsADirectoryError(
            f"{str(target)!r} is a symbolic link; replace the directory it leads to, "
            f"{os.path.realpath(target)!r}"
        )
    if not target.exists():
        os.rename(new, target)
        return
    if not target.is_dir():
        raise NotADirectoryError(f"{str(target)!r} is a file, not a directory to replace")
    os.chmod(new, target.stat().st_mode & 0o7777)
    _carry_over(target, new, drop)
    if _exchange(new, target):
        shutil.rmtree(new)  # now the old directory
        return
    aside = _sibling(target, "old")
    aside.rmdir()  # a free name: `target` is renamed to it
    os.rename(target, aside)
    try:
        os.rename(new, target)  # killed before this, the next `_recover` puts `aside` back
    except BaseException:
        os.rename(aside, target)
        raise
    shutil.rmtree(aside)


def _follow_umask(directory: Path) -> None:
    """Give `directory` and everything in it the modes the umask gives new files (writers
    such as `mkdtemp` and safetensors make them private)."""
    folders, files = dir_mode(), file_mode()  # the umask read once, not per file
    os.chmod(directory, folders)
    for p in directory.rglob("*"):
        if not p.is_symlink():
            os.chmod(p, folders if p.is_dir() else files)


@contextlib.contextmanager
def replaced_directory(
    target: str | os.PathLike[str], *, drop: Callable[[Path], bool] = lambda p: False, size: int
) -> Iterator[Path]:
    """A new directory to write into; when the block ends without an error, it replaces
    `target` (or the directory it links to) as a whole (see `swap_in`; entries of the old
    `target` that the block did not write are kept unless `drop(entry)`). On an error,
    `target` is left as it was; a full disk is a `DiskFullError` naming `target` and
    `size`, about the bytes the block writes.

    ```python
    with replaced_directory(out) as tmp:
        write_weights(tmp / "model.safetensors")
        write_config(tmp / "config.json")
    ```
    """
    named = Path(target)
    target = followed(named)
    if target.exists() and not target.is_dir():
        raise NotADirectoryError(f"{str(named)!r} is a file; name a directory to write into")
    target.parent.mkdir(parents=True, exist_ok=True)
    _recover(target)
    new = _sibling(target, "new")
    try:
        with naming_a_full_disk(named, size):
            yield new
            _follow_umask(new)
            swap_in(new, target, drop=drop)
    except BaseException:
        shutil.rmtree(new, ignore_errors=True)
        raise


def read_text(path: str | os.PathLike[str], kind: str) -> str:
    """The text of the `kind` file (`"TOML"`, `"JSON"`) at `path`, which must be a regular
    file (a FIFO or device could block or never end) of UTF-8 text. `FileNotFoundError`
    when it is missing, `ConfigFileError` for the rest, each naming the file."""
    path = Path(path)
    if path.is_dir():
        raise ConfigFileError(f"{path} is a directory, not a {kind} file.")
    if not path.exists():
        raise FileNotFoundError(f"No such file: {str(path)!r}.")
    if not path.is_file():
        raise ConfigFileError(
            f"{path} is not a regular file (a device, pipe or socket); name a {kind} file."
        )
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ConfigFileError(
            f"{path} is not UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start}); "
            f"{kind} files are UTF-8."
        ) from None


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The tables of the TOML file at `path` (see `read_text` for the file checks); a
    syntax error names `file:line`."""
    text = read_text(path, "TOML")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        line = re.search(r"at line (\d+)", str(e))
        where = f"{path}:{line.group(1)}" if line else str(path)
        raise ConfigFileError(f"{where}: invalid TOML: {e}") from None
    except RecursionError:
        raise ConfigFileError(
            f"{path}: invalid TOML: arrays or tables nested too deep to read."
        ) from None


def read_json(path: str | os.PathLike[str]) -> Any:
    """The value in the JSON file at `path` (see `read_text` for the file checks)."""
    text = read_text(path, "JSON")
    try:
        return json.loads(text)
    except RecursionError:
        raise ConfigFileError(
            f"{path} is not valid JSON: arrays or objects nested too deep to read."
        ) from None
    except ValueError as e:  # JSONDecodeError, or an integer of over 4300 digits
        raise ConfigFileError(f"{path} is not valid JSON: {e}") from None
