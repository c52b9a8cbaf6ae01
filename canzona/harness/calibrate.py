"""`canzona calibrate`: measure this machine into a hardware profile (docs/design.md §4.5).

Two phases, so the CLI can tell bad input from a failed run: `prepare` checks the request and fills
in the defaults (raises `CanzonaError`: nothing measured); `calibrate` measures and returns the
profile's JSON, assembled by the torch-free `canzona.calibration`.

What is measured (every time is the median of `repeats` timed repeats after warm-ups; a repeat of a
short kernel times a batch of back-to-back calls and divides, so that clock resolution and, on CUDA,
the synchronisation do not dominate):

- GEMMs in bf16 and fp32, square (n, n, n) and skinny (n, n, 4n), (n, 4n, n) over a range of n:
  the best rate is the profile's peak, every point's efficiency against it its `gemm_curve`;
- one steady-state step (plus apply) of each runtime kernel (`canzona.runtime.kernels`) on the
  model's distinct matrix shapes: Muon with Newton-Schulz in bf16 and in fp32, SOAP, Shampoo;
- fp32 eigh and QR over sizes (`solver_seconds`);
- launch overhead (a tiny in-place kernel), memory bandwidth (a large copy), memory and SM (CPU:
  logical CPU) counts from the device;
- with `world_size` >= 2, or under `torchrun`: all-reduce, reduce-scatter, all-gather and
  all-to-all over group sizes and message sizes, on spawned gloo ranks (CPU) or on the launched
  process group (NCCL on CUDA), each repeat timed on the slowest rank.
"""

from __future__ import annotations

import math
import os
import platform
import re
import socket
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta, timezone
from typing import Any

import torch
import torch.distributed as dist

from canzona.calibration import DEFAULT_MODEL, MAX_SPAWNED_RANKS, Measurements, assemble_profile
from canzona.catalog import get_model
from canzona.choices import check_choice
from canzona.cost import step_dtype
from canzona.errors import CanzonaError
from canzona.hardware import COLLECTIVE_OPS, DEFAULT_PROFILE, load_profile_data, profile_from_dict
from canzona.harness.launch import report_progress, run_ranks
from canzona.optimizers import MATRIX_OPTIMIZERS, default_config
from canzona.runtime.kernels import TORCH_DTYPES, apply_update_, matrix_kernel

Progress = Callable[[int, int, str], None]

DEVICES = ("cpu", "cuda")
MAX_THREADS = 1024
MAX_DIM = 2**16  # of a --shapes matrix side
MAX_NUMEL = 2**28  # of a --shapes matrix (1 GiB in fp32)
MAX_REPEATS = 100
WARMUP = 2  # SOAP's first call only initialises its state: the second is the first real step
MIN_BATCH_S = 2e-3  # a repeat of a shorter kernel times a batch of calls
MAX_BATCH = 10_000
# A dtype's GEMMs stop growing once one takes this long: on CPUs without native bf16 a bf16 GEMM
# runs about 100x slower than fp32 (1.2 s for 512x512x2048 on an EPYC without AVX512-BF16), and its
# larger sizes add minutes but no information (the curve holds its last efficiency beyond them).
GEMM_TIME_CAP_S = 0.05
GEMM_DTYPES = ("bf16", "fp32")
# torch >= 2.13 names; the *_tensor names are deprecated aliases of the same collectives
REDUCE_SCATTER = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
ALL_GATHER = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor

# Default sizes per device: (full, --quick). CPU sizes keep a run to about a minute on a laptop.
GEMM_SIZES = {"cpu": ((64, 128, 256, 512, 1024), (64, 128, 256, 512)),
              "cuda": ((256, 512, 1024, 2048, 4096, 8192), (512, 2048, 8192))}
SOLVER_SIZES = {"cpu": ((64, 128, 256, 512), (64, 128, 256)),
                "cuda": ((256, 512, 1024, 2048, 4096), (512, 2048))}
COPY_BYTES = {"cpu": (128 * 2**20, 64 * 2**20), "cuda": (2**30, 256 * 2**20)}
MESSAGE_SIZES = (tuple(4096 * 4**i for i in range(7)), (4096, 65536, 2**20, 4 * 2**20))  # 4 KiB .. 16 MiB


@dataclass(frozen=True)
class CalibrationSettings:
    """What to measure. `prepare` fills every size from the device and `quick`; tests shrink them."""

    device: str
    model: str | None
    shapes: tuple[tuple[int, int], ...]
    world_size: int  # 1: no collectives
    launched: bool  # running under torchrun (the process group comes from the environment)
    base: str
    quick: bool
    repeats: int
    gemm_sizes: tuple[int, ...]
    solver_sizes: tuple[int, ...]
    copy_bytes: int
    message_sizes: tuple[int, ...]
    group_sizes: tuple[int, ...]
    optimizers: tuple[str, ...] = MATRIX_OPTIMIZERS
    gemm_dtypes: tuple[str, ...] = GEMM_DTYPES
    name: str | None = None
    command: str = ""
    threads: int | None = None  # torch's CPU threads while measuring (None: torch's default)
    collective_timeout_s: float = 60.0
    deadline_s: float = 900.0


def parse_shapes(text: str) -> tuple[tuple[int, int], ...]:
    """'256x512,512x512' -> ((256, 512), (512, 512)), each side in [1, MAX_DIM]."""
    shapes = []
    for part in text.split(","):
        m = re.fullmatch(r"\s*(\d{1,9})\s*[xX]\s*(\d{1,9})\s*", part)
        if not m:
            raise CanzonaError(f"--shapes: {part.strip()!r} is not ROWSxCOLS (e.g. 256x512,512x512)")
        rows, cols = int(m[1]), int(m[2])
        if not (1 <= rows <= MAX_DIM and 1 <= cols <= MAX_DIM) or rows * cols > MAX_NUMEL:
            raise CanzonaError(f"--shapes: {rows}x{cols} is out of range (sides 1..{MAX_DIM}, at most "
                               f"{MAX_NUMEL} elements)")
        shapes.append((rows, cols))
    return tuple(sorted(set(shapes)))


def launched_env() -> tuple[int, int, int, int] | None:
    """(rank, world size, local rank, local world size) under torchrun, else None."""
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    try:
        rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
        local = int(os.environ.get("LOCAL_RANK", rank))
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    except ValueError:
        raise CanzonaError("RANK / WORLD_SIZE / LOCAL_RANK are set but are not numbers") from None
    return rank, world, local, local_world


def _group_sizes(world: int, quick: bool) -> tuple[int, ...]:
    if world < 2:
        return ()
    if not quick:
        return tuple(range(2, world + 1))
    return tuple(sorted({2, world} | {2**i for i in range(1, world.bit_length()) if 2**i <= world}))


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def prepare(device: str | None = None, model: str | None = None, shapes: str | None = None,
            world_size: int | None = None, base: str | None = None, quick: bool = False,
            repeats: int | None = None, name: str | None = None, command: str = "",
            threads: int | None = None) -> CalibrationSettings:
    """Check a calibration request and fill in the defaults; raises `CanzonaError` (nothing measured).
    `device` None: cuda when available, else cpu; `model` None: `DEFAULT_MODEL`'s shapes unless `shapes`
    gives them (both given is an error: one of them would be dropped)."""
    device = default_device() if device is None else device
    check_choice(device, DEVICES, "device", error=CanzonaError)
    if device == "cuda" and not torch.cuda.is_available():
        raise CanzonaError(f"--device cuda, but CUDA is not available here (torch {torch.__version__})")
    if repeats is not None and not 1 <= repeats <= MAX_REPEATS:
        raise CanzonaError(f"--repeats must be in 1..{MAX_REPEATS}, got {repeats}")
    if threads is not None and not 1 <= threads <= MAX_THREADS:
        raise CanzonaError(f"--threads must be in 1..{MAX_THREADS}, got {threads}")
    if name is not None and not re.fullmatch(r"[\w.+-]{1,100}", name):
        raise CanzonaError("--name: use 1 to 100 letters, digits, '.', '_', '+' or '-'")
    if shapes is not None:
        if model is not None:
            raise CanzonaError(f"--model {model} and --shapes both choose the shapes timed, and --shapes would "
                               "drop the model's: give one")
        chosen = parse_shapes(shapes)
    else:
        model = DEFAULT_MODEL if model is None else model  # an empty name is refused, not the default
        chosen = tuple(sorted({tuple(p.shape) for p in get_model(model).matrix_params()}))
    env = launched_env()
    if env is not None:
        if world_size is not None and world_size != env[1]:
            raise CanzonaError(f"--world-size {world_size} but torchrun launched {env[1]} ranks (WORLD_SIZE); "
                               "leave --world-size out under torchrun")
        world = env[1]
    elif world_size is None:
        world = 1
    else:
        if not 2 <= world_size <= MAX_SPAWNED_RANKS:
            raise CanzonaError(f"--world-size must be in 2..{MAX_SPAWNED_RANKS} (ranks spawned on this machine), "
                               f"got {world_size}")
        if device == "cuda":
            raise CanzonaError("--world-size spawns gloo ranks on the CPU; for NCCL on GPUs launch under torchrun: "
                               "torchrun --nproc-per-node N -m cli.main calibrate --device cuda ...")
        world = world_size
    base = DEFAULT_PROFILE if base is None else base  # as --model: an empty name is refused
    data, where = load_profile_data(base)
    profile_from_dict(data, where)  # the base must be a valid profile
    full = 1 if quick else 0
    groups = _group_sizes(world, quick)
    rows = len(groups) * len(COLLECTIVE_OPS) * len(MESSAGE_SIZES[full])
    return CalibrationSettings(
        device=device, model=model, shapes=chosen, world_size=world, launched=env is not None, base=base,
        quick=quick, repeats=repeats or (3 if quick else 5),
        gemm_sizes=GEMM_SIZES[device][full], solver_sizes=SOLVER_SIZES[device][full],
        copy_bytes=COPY_BYTES[device][full], message_sizes=MESSAGE_SIZES[full],
        group_sizes=groups, name=name, command=command, threads=threads,
        deadline_s=120.0 + 3.0 * rows)  # a spawned run that outlasts this has hung


# --- timing ---------------------------------------------------------------------------------------


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def median_seconds(fn: Callable[[], Any], device: torch.device, repeats: int, warmup: int = WARMUP,
                   min_batch_s: float = MIN_BATCH_S) -> float:
    """Median seconds of one call of `fn` over `repeats` timed repeats, after `warmup` calls; a call
    shorter than `min_batch_s` is timed in batches of back-to-back calls (one synchronisation per
    batch), and the batch time divided by its size."""
    for _ in range(warmup):
        fn()
    sync(device)
    t0 = time.perf_counter()
    fn()
    sync(device)
    once = time.perf_counter() - t0
    batch = max(1, min(MAX_BATCH, math.ceil(min_batch_s / max(once, 1e-9))))
    runs = []
    for _ in range(repeats):
        sync(device)
        t0 = time.perf_counter()
        for _ in range(batch):
            fn()
        sync(device)
        runs.append((time.perf_counter() - t0) / batch)
    return statistics.median(runs)


def time_step(optimizer: str, shape: tuple[int, int], device: torch.device, repeats: int,
              cfg: object | None = None) -> float:
    """Median seconds of one steady-state step of a runtime kernel plus its apply (the warm-ups
    initialise the state: SOAP's first call computes no update)."""
    cfg = cfg if cfg is not None else default_config(optimizer)
    kernel = matrix_kernel(optimizer)
    gen = torch.Generator(device=device).manual_seed(0)
    param = torch.randn(shape, device=device, generator=gen)
    grad = torch.randn(shape, device=device, generator=gen)
    state: dict = {}

    def step() -> None:
        update = kernel(grad, state, cfg, 1e-3)
        if update is not None:
            apply_update_(param, update.direction, update)

    return median_seconds(step, device, repeats, WARMUP)


def kernel_variants(optimizers: tuple[str, ...]) -> list[tuple[str, object, str]]:
    """(optimizer, config, dtype) to time: Muon's Newton-Schulz in bf16 (its default) and in fp32."""
    out = []
    for opt in optimizers:
        cfg = default_config(opt)
        out.append((opt, cfg, step_dtype(opt, cfg)))
        if hasattr(cfg, "ns_dtype"):  # Newton-Schulz's dtype is a choice: time both
            other = "fp32" if cfg.ns_dtype != "fp32" else "bf16"
            out.append((opt, replace(cfg, ns_dtype=other), other))
    return out


def gemm_shapes(sizes: tuple[int, ...]) -> list[tuple[int, int, int]]:
    """(m, n, k) per size: square, a Gram-like k = 4n, and an update-like n = 4m."""
    return [s for n in sizes for s in ((n, n, n), (n, n, 4 * n), (n, 4 * n, n))]


def time_gemm(m: int, n: int, k: int, dtype: str, device: torch.device, repeats: int) -> float:
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(m, k, device=device, generator=gen).to(TORCH_DTYPES[dtype])
    b = torch.randn(k, n, device=device, generator=gen).to(TORCH_DTYPES[dtype])
    out = torch.empty(m, n, device=device, dtype=TORCH_DTYPES[dtype])
    return median_seconds(lambda: torch.matmul(a, b, out=out), device, repeats)


def time_solver(op: str, k: int, device: torch.device, repeats: int) -> float:
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(k, k, device=device, generator=gen)
    if op == "eigh":
        spd = x @ x.T / k + torch.eye(k, device=device)
        return median_seconds(lambda: torch.linalg.eigh(spd), device, repeats)
    return median_seconds(lambda: torch.linalg.qr(x), device, repeats)


def time_launch(device: torch.device, repeats: int) -> float:
    x = torch.zeros(1, device=device)
    return median_seconds(lambda: x.add_(1.0), device, repeats)


def time_copy(nbytes: int, device: torch.device, repeats: int) -> float:
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return median_seconds(lambda: dst.copy_(src), device, repeats, min_batch_s=0.0)


def memory_bytes(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).total_memory)
    try:
        return int(os.sysconf("SC_PHYS_PAGES")) * int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):  # not POSIX
        return None


def processors(device: torch.device) -> int | None:
    if device.type == "cuda":
        return int(torch.cuda.get_device_properties(device).multi_processor_count)
    return os.cpu_count()


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    name = platform.processor() or "CPU"
    try:
        with open("/proc/cpuinfo") as f:
            found = re.search(r"^model name\s*:\s*(.+)$", f.read(), re.MULTILINE)
        if found:
            name = found[1].strip()
    except OSError:
        pass
    return f"{name} ({os.cpu_count()} logical CPUs)"


# --- collectives ----------------------------------------------------------------------------------


def _time_collective(op: str, group_size: int, size: int, group: Any, device: torch.device, repeats: int,
                     warmup: int) -> tuple[int, float]:
    """(bytes, median seconds of the slowest member) of one collective whose buffer is about `size`
    bytes of fp32 (rounded down to a multiple of the group size)."""
    elems = max(group_size, size // 4 // group_size * group_size)
    x = torch.zeros(elems, device=device)
    if op == "all-reduce":
        def fn() -> None:
            dist.all_reduce(x, group=group)
    elif op == "reduce-scatter":
        out = torch.empty(elems // group_size, device=device)

        def fn() -> None:
            REDUCE_SCATTER(out, x, group=group)
    elif op == "all-gather":
        mine = torch.zeros(elems // group_size, device=device)

        def fn() -> None:
            ALL_GATHER(x, mine, group=group)
    else:
        out = torch.empty(elems, device=device)

        def fn() -> None:
            dist.all_to_all_single(out, x, group=group)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        dist.barrier(group=group)
        sync(device)
        t0 = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64, device=device)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX, group=group)
    return elems * 4, statistics.median(slowest.tolist())


def collective_rows(rank: int, world: int, message_sizes: tuple[int, ...], group_sizes: tuple[int, ...],
                    repeats: int, warmup: int, device: torch.device,
                    tick: Progress = report_progress) -> list[list]:
    """Every op over every group size (ranks 0..n-1) and message size, on the initialised default
    group; rank 0, a member of every group, returns the rows [op, group size, bytes, seconds]."""
    groups = {n: None if n == world else dist.new_group(list(range(n))) for n in group_sizes}
    total = len(group_sizes) * len(COLLECTIVE_OPS) * len(message_sizes)
    rows: list[list] = []
    done = 0
    for n in group_sizes:
        for op in COLLECTIVE_OPS:
            for size in message_sizes:
                if rank < n:
                    nbytes, seconds = _time_collective(op, n, size, groups[n], device, repeats, warmup)
                    rows.append([op, n, nbytes, seconds])
                done += 1
                if rank == 0:
                    tick(done, total, f"{op} on {n} ranks, {size} bytes")
        dist.barrier()  # the ranks outside this group wait for it
    return rows


def _spawned_worker(rank: int, world: int, message_sizes: tuple[int, ...], group_sizes: tuple[int, ...],
                    repeats: int, warmup: int) -> list[list]:
    return collective_rows(rank, world, message_sizes, group_sizes, repeats, warmup, torch.device("cpu"))


def _launched_collectives(s: CalibrationSettings, progress: Progress) -> tuple[int, list[list], str, int]:
    """Under torchrun: (rank, rows, backend, ranks per machine) on the launched process group."""
    rank, world, local, local_world = launched_env()  # type: ignore[misc]
    owned = not dist.is_initialized()
    if s.device == "cuda":
        torch.cuda.set_device(local)
    if owned:
        dist.init_process_group("nccl" if s.device == "cuda" else "gloo",
                                timeout=timedelta(seconds=s.collective_timeout_s))
    device = torch.device("cuda", local) if s.device == "cuda" else torch.device("cpu")
    backend = str(dist.get_backend())
    try:
        rows = collective_rows(rank, world, s.message_sizes, s.group_sizes, s.repeats, WARMUP, device,
                               tick=progress)
    finally:
        if owned:
            dist.destroy_process_group()
    return rank, rows, backend, local_world


# --- the whole run --------------------------------------------------------------------------------


def _versions() -> dict[str, str]:
    from importlib.metadata import PackageNotFoundError, version

    try:
        mine = version("canzona")
    except PackageNotFoundError:
        mine = "unknown"
    return {"torch": torch.__version__, "python": platform.python_version(), "canzona": mine}


def _steps(s: CalibrationSettings) -> int:
    return (len(s.gemm_dtypes) * len(gemm_shapes(s.gemm_sizes)) + 2 + 2 * len(s.solver_sizes)
            + len(kernel_variants(s.optimizers)) * len(s.shapes)
            + len(s.group_sizes) * len(COLLECTIVE_OPS) * len(s.message_sizes))


def is_writer() -> bool:
    """Whether this process writes the profile: always, except on torchrun ranks other than 0."""
    env = launched_env()
    return env is None or env[0] == 0


def measure(s: CalibrationSettings, progress: Progress | None = None) -> Measurements | None:
    """Measure everything `s` asks for; None on a torchrun rank other than 0 (which only takes part
    in the collectives). A failed rank raises `CanzonaError`."""
    previous = torch.get_num_threads()
    if s.threads is not None:
        torch.set_num_threads(s.threads)
    try:
        return _measure(s, progress)
    finally:
        torch.set_num_threads(previous)


def _measure(s: CalibrationSettings, progress: Progress | None) -> Measurements | None:
    total = _steps(s)
    done = 0

    def tick(what: str, step: int = 1) -> None:
        nonlocal done
        done += step
        if progress is not None:
            progress(done, total, what)

    hostname = socket.gethostname() or "localhost"
    m = Measurements(device=s.device, device_name="", hostname=hostname, repeats=s.repeats, warmup=WARMUP,
                     versions=_versions(), command=s.command, model=s.model, shapes=list(s.shapes),
                     world_size=s.world_size)
    # collectives first: under torchrun the other ranks can then leave while rank 0 measures alone
    collectives = len(s.group_sizes) * len(COLLECTIVE_OPS) * len(s.message_sizes)
    if s.group_sizes:
        def sub(d: int, t: int, what: str) -> None:
            if progress is not None:
                progress(done + d, total, what)

        if s.launched:
            rank, rows, m.backend, m.local_size = _launched_collectives(s, sub)
            m.launcher = "torchrun"
            if rank != 0:
                return None
        else:
            per_rank = run_ranks(_spawned_worker, s.world_size, s.message_sizes, s.group_sizes, s.repeats,
                                 WARMUP, deadline_s=s.deadline_s, collective_timeout_s=s.collective_timeout_s,
                                 progress=sub)
            rows, m.backend, m.local_size, m.launcher = per_rank[0], "gloo", s.world_size, "spawned"
        m.collective_rows = [(op, int(n), int(b), float(t)) for op, n, b, t in rows]
        tick("collectives measured", collectives)

    if s.device == "cuda":
        launched = launched_env()
        device = torch.device("cuda", launched[2] if launched else torch.cuda.current_device())
    else:
        device = torch.device("cpu")
    m.device_name = device_name(device)
    m.threads = torch.get_num_threads()
    m.matmul_precision = torch.get_float32_matmul_precision()
    m.memory_bytes = memory_bytes(device)
    m.sms = processors(device)
    by_flops = sorted(gemm_shapes(s.gemm_sizes), key=lambda shape: math.prod(shape))
    for dtype in s.gemm_dtypes:
        capped_at = None
        for mm, nn, kk in by_flops:
            if capped_at is not None:
                tick(f"GEMM {dtype} {mm}x{nn}x{kk} skipped (one of {capped_at} took over {GEMM_TIME_CAP_S} s)")
                continue
            seconds = time_gemm(mm, nn, kk, dtype, device, s.repeats)
            m.gemm_points.append((dtype, mm, nn, kk, seconds))
            if seconds > GEMM_TIME_CAP_S:
                capped_at = f"{mm}x{nn}x{kk}"
            tick(f"GEMM {dtype} {mm}x{nn}x{kk}")
    m.launch_s = time_launch(device, s.repeats)
    tick("launch overhead")
    m.copy_bytes = s.copy_bytes
    m.copy_s = time_copy(s.copy_bytes, device, s.repeats)
    tick("memory bandwidth")
    for op in ("eigh", "qr"):
        for k in s.solver_sizes:
            m.solver_rows.setdefault(op, []).append((k, time_solver(op, k, device, s.repeats)))
            tick(f"{op} {k}x{k}")
    for opt, cfg, dtype in kernel_variants(s.optimizers):
        for shape in s.shapes:
            m.optimizer_rows.append((opt, shape[0], shape[1], dtype, time_step(opt, shape, device, s.repeats, cfg)))
            tick(f"{opt} ({dtype}) {shape[0]}x{shape[1]}")
    m.date = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return m


def calibrate(s: CalibrationSettings, progress: Progress | None = None) -> dict[str, Any] | None:
    """Measure and assemble the profile's JSON (validated by `profile_from_dict`); None on a torchrun
    rank other than 0."""
    m = measure(s, progress)
    if m is None:
        return None
    base, where = load_profile_data(s.base)
    profile = assemble_profile(m, base, str(s.base), name=s.name)
    profile_from_dict(profile, "calibrated profile")  # what is written must load
    return profile
