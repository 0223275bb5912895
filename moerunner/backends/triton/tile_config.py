# Tile configurations of the triton backend's grouped GEMMs: heuristic default + tuned files.
#
# A tuned file covers one (E, N = I, K = H, scheme, device name) and maps token counts to a
# pair of tiles (GEMM1, GEMM2) sharing BLOCK_M (the alignment step pads to it). Files follow
# one schema (SCHEMA below); ``moerunner tune`` (``tune.py``) writes them, by default into the
# user tile folder (``user_tile_dir``). Weights look their file up once, when prepared
# (``find_tiles``): in the folders of ``TritonOptions.tile_dirs`` (default: the user tile
# folder), then in ``configs/`` shipped beside this module; the first file found is used
# whole. A call takes the entry whose token count is nearest to its own; with no file the
# heuristic below answers. The environment is read in one place: where the user's cache
# folder is (``device_files.user_cache_dir``). Files are keyed by ``gpu_name`` (None off
# CUDA: heuristic tiles) in ``device_key`` form. A file that cannot be a tuned file (bad
# content) raises a ValueError naming it; a folder or a symbolic link to nothing where a file
# belongs, and a ``tile_dirs`` entry that is not a folder, are passed over with one warning
# each (as ``backend_table`` treats a user table it cannot use).
#
# Files name a scheme by ``registered_name`` (schemes with equal fields share files). The
# heuristic keys on scheme fields: the MMA's operand type (``_operands.mma_operand``) and
# whether weight scales change along K inside a tile (block-scaled fp8).

from __future__ import annotations

import functools
import json
import os
import re
import stat
import warnings
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path

from ...device_files import device_key, user_cache_dir, write_text_atomic
from ...quant.schemes import QuantScheme, get_scheme, registered_name
from ._operands import mma_operand

SCHEMA = "moerunner.triton.tiles/1"
#: Tile files shipped with the package (searched after the user's folders).
SHIPPED_DIR = Path(__file__).with_name("configs")
#: Upper ends of a tile's pipeline depth and launch group, so that a typo in a file is
#: refused when it is read, not met (if at all) inside Triton's compiler. Each stage holds
#: one A and one B tile in shared memory (at most 227 KB a block on Hopper): the tuner
#: searches 2-6 stages and the shipped files use 3-6; deeper pipelines only cost shared
#: memory and compile time. GROUP_M M-blocks share each weight tile while it is in L2: the
#: tuner and the shipped files use 1 and 8, and the kernel multiplies GROUP_M by the N-block
#: count in int32, which a value like 10**9 overflows.
MAX_STAGES = 8
MAX_GROUP_M = 64


def user_tile_dir() -> Path:
    """The user tile folder: ``tiles`` in the user cache folder (``user_cache_dir``:
    ``$XDG_CACHE_HOME/moerunner`` or ``~/.cache/moerunner``). ``moerunner tune`` writes
    there by default and the runtime reads it first (``TritonOptions.tile_dirs=None``)."""
    return user_cache_dir() / "tiles"


def tile_folders(tile_dirs: Sequence[str | os.PathLike] | None) -> tuple[Path, ...]:
    """Folders searched for tuned files, in order: ``tile_dirs`` (None: the user tile
    folder), then the shipped ones."""
    first = (user_tile_dir(),) if tile_dirs is None else tuple(Path(d) for d in tile_dirs)
    return (*first, SHIPPED_DIR)


@dataclass(frozen=True)
class TileConfig:
    """Tile of one grouped GEMM: block sizes, launch order group, warps, pipeline depth and
    how many programs share each tile's K loop (``split_k``: None leaves it to the launcher,
    ``_split_k.split_k_for``; a count is capped at the K steps, and not taken where the partial
    sums would be large. For calls whose tiles are too few to keep the GPU busy, see
    ``_gemm_kernel.moe_gemm_kernel``)."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int = 8
    num_warps: int = 4
    num_stages: int = 3
    split_k: int | None = None

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n", "block_k", "num_warps"):
            value = getattr(self, name)
            top = 32 if name == "num_warps" else 4096
            if not _count(value) or value & (value - 1) or value > top:
                raise ValueError(f"{name} must be a power of two up to {top}, got {value!r}")
        for name, top in (("group_m", MAX_GROUP_M), ("num_stages", MAX_STAGES)):
            if not _count(getattr(self, name)) or getattr(self, name) > top:
                raise ValueError(
                    f"{name} must be a positive int up to {top}, got {getattr(self, name)!r}"
                )
        if self.split_k is not None and not _count(self.split_k):
            raise ValueError(f"split_k must be None or at least 1, got {self.split_k!r}")

    @classmethod
    def from_dict(cls, d: dict) -> TileConfig:
        """Build from a JSON object with these field names (``split_k`` may be left out or
        null: the launcher's choice); ValueError for anything else."""
        names = [f.name for f in fields(cls)]
        if not isinstance(d, dict):
            raise ValueError(f"a tile must be an object with fields {names}, got {d!r}")
        unknown = sorted(set(d) - set(names))
        missing = [n for n in ("block_m", "block_n", "block_k") if n not in d]
        if unknown or missing:
            raise ValueError(f"tile {d}: unknown fields {unknown}, missing {missing}")
        return cls(**d)

    def to_dict(self) -> dict:
        """JSON-ready form (``split_k`` only when set, as files written before it)."""
        d = asdict(self)
        if self.split_k is None:
            del d["split_k"]
        return d


@dataclass(frozen=True)
class MoeTiles:
    """Tiles of GEMM1 (w13) and GEMM2 (w2); both use ``gemm1.block_m`` rows per block."""

    gemm1: TileConfig
    gemm2: TileConfig

    def __post_init__(self) -> None:
        if self.gemm1.block_m != self.gemm2.block_m:
            raise ValueError(
                f"gemm1.block_m ({self.gemm1.block_m}) and gemm2.block_m "
                f"({self.gemm2.block_m}) must be equal: both GEMMs share one alignment"
            )

    def to_dict(self) -> dict:
        """JSON-ready form."""
        return {"gemm1": self.gemm1.to_dict(), "gemm2": self.gemm2.to_dict()}

    def unpinned(self) -> MoeTiles:
        """These tiles with ``split_k`` left to the launcher (itself if neither pins one)."""
        if self.gemm1.split_k is None and self.gemm2.split_k is None:
            return self
        return MoeTiles(replace(self.gemm1, split_k=None), replace(self.gemm2, split_k=None))

    @classmethod
    def from_dict(cls, d: dict) -> MoeTiles:
        """Inverse of ``to_dict``; ValueError for anything else."""
        if not isinstance(d, dict) or set(d) != {"gemm1", "gemm2"}:
            raise ValueError(f"expected an object with 'gemm1' and 'gemm2' tiles, got {d!r}")
        return cls(TileConfig.from_dict(d["gemm1"]), TileConfig.from_dict(d["gemm2"]))


def is_count_text(text: str) -> bool:
    """Whether a JSON key spells a count in ASCII digits (``str.isdigit`` alone also passes
    "²", which ``int`` refuses)."""
    return text.isascii() and text.isdigit()


def _count(value: object) -> bool:
    """A positive int (not a bool: JSON's true would read as 1)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def scheme_key(scheme: str | QuantScheme) -> str:
    """How files name a scheme: the registered name of its fields (``registered_name``)."""
    return registered_name(get_scheme(scheme))


def config_file_name(
    num_experts: int,
    n: int,
    k: int,
    scheme: str | QuantScheme,
    device_name: str,
    layout: str | None = None,
) -> str:
    """Name of the tuned file for one shape, scheme, weight layout (None: the scheme's only
    or default one) and device."""
    lay = f",layout={layout}" if layout else ""
    key = scheme_key(scheme)
    return f"E={num_experts},N={n},K={k},scheme={key}{lay}{_device_suffix(device_name)}"


def _device_suffix(device_name: str) -> str:
    """How every tuned file name for ``device_name`` ends."""
    return f",device={device_key(device_name)}.json"


def tuned_files(folder: Path, device_name: str) -> list[Path]:
    """The tuned files in ``folder`` for ``device_name`` (none where it is no folder)."""
    if not folder.is_dir():
        return []
    return sorted(folder.glob("E=*" + _device_suffix(device_name)))


def write_config_file(
    path: Path,
    num_experts: int,
    n: int,
    k: int,
    scheme: str | QuantScheme,
    device_name: str,
    tiles_by_tokens: dict[int, MoeTiles],
    extra: dict | None = None,
    layout: str | None = None,
) -> None:
    """Write one tuned file in the shared schema (``layout`` as in ``config_file_name``),
    whole or not at all (``write_text_atomic``): an interrupted write leaves the earlier file,
    never a truncated one that ``moerunner tune`` then refuses to merge into."""
    if not tiles_by_tokens:
        raise ValueError(f"{path}: no token counts to write (a tile file holds at least one)")
    key = {"E": num_experts, "N": n, "K": k, "scheme": scheme_key(scheme), "device": device_name}
    if layout:
        key["layout"] = layout
    doc = {
        "schema": SCHEMA,
        "key": key,
        "by_tokens": {str(t): tiles.to_dict() for t, tiles in sorted(tiles_by_tokens.items())},
    }
    if extra:
        doc["measured"] = extra
    write_text_atomic(path, json.dumps(doc, indent=1, sort_keys=True) + "\n")


def is_tile_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a tuned file moerunner wrote: a JSON object whose top-level
    ``schema`` is ``SCHEMA`` (``write_config_file`` marks every file so). ``moerunner tune``
    merges only into such files and refuses any other file under a tuned file's name."""
    try:
        doc = json.loads(Path(path).read_bytes())
    except (OSError, UnicodeDecodeError, ValueError):
        return False
    return isinstance(doc, dict) and doc.get("schema") == SCHEMA


def config_files_of(
    folder: Path, num_experts: int, n: int, k: int, scheme: str | QuantScheme, device_name: str
) -> list[Path]:
    """The existing files in ``folder`` named as tuned files of this shape, scheme and device,
    whatever their weight layout (``config_file_name``)."""
    if not folder.is_dir():
        return []
    head, _, tail = config_file_name(num_experts, n, k, scheme, device_name).partition(",device=")
    pattern = re.compile(re.escape(head) + r"(,layout=[^,/]+)?" + re.escape(",device=" + tail))
    return sorted(p for p in folder.iterdir() if pattern.fullmatch(p.name))


def load_config_file(path: str, key: tuple | None = None) -> dict[int, MoeTiles] | None:
    """Tiles by token count from a tuned file, or None when no file is there. A file that is
    not a valid tuned file raises a ValueError naming it and what is wrong, as does one whose
    ``key`` names another shape than ``key`` (``file_key``) where that is given. A folder or
    a symbolic link to nothing under the file's name is passed over (None) with a warning,
    once. Read again when the file changes (cached by path, modification time and size)."""
    try:
        st = os.stat(path)
    except OSError:
        if os.path.islink(path):  # the link is there, its target is not
            _warn_ignored(path, f"a symbolic link to {os.readlink(path)!r}, which does not exist")
        return None
    if not stat.S_ISREG(st.st_mode):
        _warn_ignored(path, "not a file (a folder?)")
        return None
    return _load_config_file(str(path), st.st_mtime_ns, st.st_size, key)


def _warn_ignored(path: str | os.PathLike, why: str) -> None:
    _warn_once(
        f"moerunner: ignoring the tile file {path} ({why}); the triton backend takes the next "
        "tile folder's file or its default tiles instead (fix or remove it, e.g. re-run "
        "'moerunner tune')"
    )


@functools.lru_cache(maxsize=256)
def _warn_once(message: str) -> None:
    """Warn once per process: tiles are looked up each time weights are prepared."""
    warnings.warn(message, RuntimeWarning, stacklevel=4)


def file_key(
    num_experts: int, n: int, k: int, scheme: str | QuantScheme, device_name: str, layout=None
) -> tuple:
    """What a tuned file's ``key`` must hold for this shape (``load_config_file``)."""
    return (num_experts, n, k, scheme_key(scheme), device_key(device_name), layout or None)


@functools.lru_cache(maxsize=256)
def _load_config_file(path: str, mtime_ns: int, size: int, key: tuple | None):
    def bad(why: str) -> ValueError:
        return ValueError(
            f"{path}: not a usable moerunner tile file: {why}; fix or delete it, or write it "
            "again with moerunner tune"
        )

    try:
        doc = json.loads(Path(path).read_bytes())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise bad(f"unreadable as JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise bad("its top level is not a JSON object")
    if doc.get("schema") != SCHEMA:
        raise ValueError(f"{path}: schema {doc.get('schema')!r} is not {SCHEMA!r}")
    held = doc.get("key")
    if not isinstance(held, dict):  # the key says which shape the tiles were tuned for
        raise bad(f"'key' is missing or not an object of E, N, K, scheme, device, got {held!r}")
    try:
        found = (held["E"], held["N"], held["K"], held["scheme"], device_key(held["device"]))
        found += (held.get("layout"),)
    except (KeyError, TypeError, AttributeError):
        raise bad(f"its key {held!r} lacks E, N, K, scheme or device") from None
    if key is not None and found != key:
        raise bad(f"its key {held!r} names another shape than its file name ({key})")
    by_tokens = doc.get("by_tokens")
    if not isinstance(by_tokens, dict):
        raise bad("'by_tokens' is missing or not an object")
    if not by_tokens:  # read as no file: the heuristic answered, with no word of why
        raise bad("'by_tokens' holds no token counts")
    table, spelled = {}, {}
    for tokens, entry in by_tokens.items():
        if not is_count_text(tokens) or int(tokens) < 1:
            raise bad(f"token count {tokens!r} is not a positive integer")
        count = int(tokens)
        if count in spelled:  # "1" and "01": one would silently replace the other
            raise bad(f"token counts {spelled[count]!r} and {tokens!r} are the same count")
        spelled[count] = tokens
        try:
            table[count] = MoeTiles.from_dict(entry)
        except ValueError as exc:
            raise bad(f"entry {tokens!r}: {exc}") from None
    return table


load_config_file.cache_clear = _load_config_file.cache_clear  # type: ignore[attr-defined]


def mma_8bit(scheme: str | QuantScheme) -> bool:
    """Whether the kernels feed ``scheme``'s GEMMs to the MMA as 8-bit operands (fp8 or
    int8 weights with quantized inputs); weight-only schemes run it in the hidden dtype."""
    return mma_operand(get_scheme(scheme)) in ("fp8", "int8")


def k_blocked(scheme: str | QuantScheme) -> bool:
    """Whether ``scheme``'s weight scales change along K inside the MMA (block-scaled fp8):
    BLOCK_K then divides the K block or is a multiple of it."""
    s = get_scheme(scheme)
    return mma_operand(s) == "fp8" and s.granularity in ("block", "group")


# Default tiles by MMA family and rows per expert (``rows_per_expert``), read off the tuned
# files shipped in ``configs/`` (H100 and H200; GPT-OSS, Qwen3-30B, DeepSeek-V3, Mixtral):
# across those shapes the tuner's BLOCK_M follows the rows an expert gets, not E, N or K, and
# within a row band the same few tiles win. Where the two GPUs disagree the H100's choice is
# taken, except from 64 to 160 rows per expert: there some H100 files keep 64-row tiles
# (Qwen3-30B-A3B T = 1024, Mixtral-8x7B T = 256; re-tuned 128-row ones ran within 1 % of
# them), but on both GPUs the four shapes without a file (E 16-64, I 1024-10752) ran 1.2x
# faster with 128-row ones (see "plain").
# Each row is (rows per expert up
# to, GEMM1 tile, GEMM2 tile); every tile is one that ``tune.candidate_tiles`` searches for
# that band, so a tuned file can only improve on it. Every band keeps far more tiles than an
# H100 has SMs (from 16 rows per expert up, E * N / BLOCK_N alone is >= 8 waves for the
# shapes of the files and of the unseen presets), so the SM count does not enter.
_INF = float("inf")
_DEFAULT_TILES: dict[str, tuple[tuple[float, TileConfig, TileConfig], ...]] = {
    # Weights reach the MMA in the hidden dtype as stored (bf16, fp16) or decoded from
    # 8 bits (int8 W8A16, mxfp8). Decode streams weights: 16 rows, long K steps, GEMM1
    # narrower (its MMA is gate and up, 2 * BLOCK_N wide). From 64 rows per expert on both
    # GEMMs take two-warpgroup 128-row tiles (four shapes without a file at 68-128 rows:
    # 64-row tiles ran at 0.82-0.84x the tuner's best on an H200, where these were the
    # best, and within 0.995-1.005x of the best on an H100; at exactly 64, where about half
    # the experts overflow one 64-row block, 128-row tiles ran 1.07-1.14x faster for
    # Mixtral-8x7B and Qwen3-30B-A3B on both GPUs), past ~160 GEMM2 256 wide.
    "plain": (
        (12, TileConfig(16, 64, 256, 1, 4, 4), TileConfig(16, 128, 256, 1, 4, 4)),
        (24, TileConfig(32, 128, 128, 1, 4, 3), TileConfig(32, 128, 128, 1, 4, 3)),
        (63, TileConfig(64, 128, 64, 8, 4, 3), TileConfig(64, 128, 64, 8, 4, 3)),  # up to 63 rows
        (160, TileConfig(128, 128, 64, 8, 8, 3), TileConfig(128, 128, 64, 8, 8, 3)),
        (384, TileConfig(128, 128, 64, 8, 8, 4), TileConfig(128, 256, 64, 8, 8, 4)),
        (_INF, TileConfig(128, 128, 64, 8, 8, 3), TileConfig(128, 256, 64, 8, 8, 3)),
    ),
    # 8-bit operands (fp8 / int8 weights against quantized inputs): K steps of 128 (a
    # block-scaled K block or a multiple of its divisors), and 64-row tiles from 24 rows per
    # expert up (the tuner's H100 choice from 32 to 512 rows until padding rows stopped
    # being read; since then both GPUs' DeepSeek-V3 fp8_block files take 128-row tiles with
    # a 64-column GEMM1 from 128 rows on, not yet measured on shapes without a file); GEMM1's
    # 128 columns are whole groups, so it quantizes GEMM2's fp8_group128 input in its
    # epilogue.
    "qdot8": (
        (12, TileConfig(16, 128, 128, 1, 4, 3), TileConfig(16, 128, 128, 1, 4, 3)),
        (24, TileConfig(32, 128, 128, 1, 4, 3), TileConfig(32, 128, 128, 1, 4, 3)),
        (_INF, TileConfig(64, 128, 128, 8, 8, 3), TileConfig(64, 128, 128, 8, 4, 4)),
    ),
    # Packed 4-bit weights decoded in registers (e2m1, int4): K steps of 128 (one chunk of
    # the fragment layout, whole chunks of the split one); the decode costs per weight, so
    # row blocks grow later than for plain weights. GEMM1 keeps BLOCK_N <= 128 (the fragment
    # layout takes at most 256 weight rows, gate and up together). Decode ends at 16 rows,
    # where the tuner's packed decode search does.
    "packed": (
        (16, TileConfig(16, 64, 128, 1, 4, 3), TileConfig(16, 128, 128, 1, 4, 3)),
        (48, TileConfig(32, 64, 128, 8, 4, 3), TileConfig(32, 128, 128, 8, 4, 3)),
        (256, TileConfig(64, 64, 128, 8, 4, 3), TileConfig(64, 128, 128, 8, 4, 3)),
        (_INF, TileConfig(128, 64, 128, 8, 8, 3), TileConfig(128, 128, 128, 8, 8, 3)),
    ),
}


def rows_per_expert(num_tokens: int, top_k: int, num_experts: int) -> float:
    """Rows (token, expert pairs) an active expert gets on average: ``T * k`` spread over
    ``min(E, T * k)`` experts. Tile choice (``heuristic_tiles``, ``tune.candidate_tiles``)
    keys on it."""
    pairs = max(1, num_tokens * top_k)
    return pairs / max(1, min(num_experts, pairs))


def tile_family(scheme: str | QuantScheme, dtype_bytes: int = 2) -> str:
    """Which default-tile family (``_DEFAULT_TILES``) ``scheme`` takes: "qdot8" for 8-bit
    MMA operands (``mma_8bit`` with 1-byte stored weights), "packed" for 4-bit weights
    decoded in registers, else "plain"."""
    scheme = get_scheme(scheme)
    if mma_8bit(scheme) and dtype_bytes == 1:
        return "qdot8"
    return "packed" if scheme.packed else "plain"


def _fit_block_k(tile: TileConfig, k: int, dtype_bytes: int) -> TileConfig:
    """``tile`` with BLOCK_K no longer than K needs (a power of two, at least 64), and halved
    for 4-byte weights (twice the shared memory per element)."""
    bk = tile.block_k
    if dtype_bytes > 2:
        bk //= 2
    whole = 64
    while whole < k:
        whole *= 2
    bk = max(min(bk, whole), 32 if dtype_bytes > 2 else 64)
    return tile if bk == tile.block_k else TileConfig(**{**asdict(tile), "block_k": bk})


def heuristic_tiles(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    n: int,
    k: int,
    scheme: str | QuantScheme,
    dtype_bytes: int = 2,
) -> MoeTiles:
    """Default tiles where no tuned file exists: the row band of ``rows_per_expert`` in the
    scheme's family (``tile_family``, ``_DEFAULT_TILES``).

    ``n`` is I, ``k`` is H (GEMM1's K; GEMM2's K is ``n``). ``dtype_bytes``: bytes per
    stored weight element (1 for 8-bit and packed weights, 4 for fp32).
    """
    rpe = rows_per_expert(num_tokens, top_k, num_experts)
    bands = _DEFAULT_TILES[tile_family(scheme, dtype_bytes)]
    g1, g2 = next((a, b) for upto, a, b in bands if rpe <= upto)
    return MoeTiles(_fit_block_k(g1, k, dtype_bytes), _fit_block_k(g2, n, dtype_bytes))


@dataclass(frozen=True)
class TileSource:
    """Where one prepared layer's tiles come from: a tuned file's table (``path``) or, with
    none found, the heuristic. Found once per prepared weights (``find_tiles``); a call only
    picks the entry nearest to its token count."""

    num_experts: int
    n: int
    k: int
    scheme: str | QuantScheme
    dtype_bytes: int = 2
    path: Path | None = None
    table: dict[int, MoeTiles] | None = field(default=None, compare=False, repr=False)

    def lookup(self, num_tokens: int, top_k: int) -> MoeTiles:
        """Tuned tiles for the nearest token count, else ``heuristic_tiles``. A call larger
        than its entry's token count takes that entry with ``split_k`` unset (``unpinned``):
        a split is tuned to the tile count of its bucket, and a larger call has more tiles,
        so the launcher's rule decides there (GPT-OSS-120B mxfp4 at T = 6 with the T = 4
        entry's splits ran 0.93x the same tiles unsplit on an H100)."""
        if self.table:
            nearest = min(self.table, key=lambda t: (abs(t - num_tokens), t))
            tiles = self.table[nearest]
            return tiles.unpinned() if num_tokens > nearest else tiles
        return heuristic_tiles(
            num_tokens, top_k, self.num_experts, self.n, self.k, self.scheme, self.dtype_bytes
        )

    def describe(self) -> str:
        """The file used, or why the heuristic answers."""
        return str(self.path) if self.path is not None else "heuristic (no tuned file)"


def find_tiles(
    num_experts: int,
    n: int,
    k: int,
    scheme: str | QuantScheme,
    device_name: str | None,
    dtype_bytes: int = 2,
    layout: str | None = None,
    tile_dirs: Sequence[str | os.PathLike] | None = None,
) -> TileSource:
    """The tiles of one shape, scheme and weight layout on ``device_name`` (None: off the
    GPU, heuristic only): the first tuned file in ``tile_folders(tile_dirs)``. ``layout``
    names a prepared weight layout whose tiles are tuned apart (``WeightLayout.tile_key``)."""
    if device_name is not None:
        name = config_file_name(num_experts, n, k, scheme, device_name, layout)
        key = file_key(num_experts, n, k, scheme, device_name, layout)
        for folder in tile_folders(tile_dirs):
            if tile_dirs is not None and not folder.is_dir() and folder != SHIPPED_DIR:
                # A mistyped folder would drop the user's tuned tiles without a word. (The
                # default user folder is missing until the first tune: that is no mistake.)
                why = "is not a folder" if folder.exists() else "does not exist"
                _warn_once(
                    f"moerunner: TritonOptions.tile_dirs entry {str(folder)!r} {why}: no tuned "
                    "tiles are read from it (the next folders, then the default tiles, answer)"
                )
                continue
            path = folder / name
            table = load_config_file(str(path), key)
            if table:
                return TileSource(num_experts, n, k, scheme, dtype_bytes, path, table)
    return TileSource(num_experts, n, k, scheme, dtype_bytes)


def lookup_tiles(
    num_tokens: int,
    top_k: int,
    num_experts: int,
    n: int,
    k: int,
    scheme: str | QuantScheme,
    device_name: str | None,
    tile_dirs: Sequence[str | os.PathLike] | None = None,
    dtype_bytes: int = 2,
    layout: str | None = None,
) -> MoeTiles:
    """``find_tiles(...).lookup(num_tokens, top_k)`` in one call (prepared weights keep
    their ``TileSource`` in ``tensors["tiles"]``)."""
    source = find_tiles(num_experts, n, k, scheme, device_name, dtype_bytes, layout, tile_dirs)
    return source.lookup(num_tokens, top_k)
