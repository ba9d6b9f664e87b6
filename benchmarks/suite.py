"""The model suite: the ecosystem's models (``suite_models.py``: transformers' and timm's
lists from torch.compile's benchmark harness, torchvision's classics) trained and run as
their users run them, eager, under ``torch.compile`` and under ``plait.jit``, every column
in one process and timed the same way.

For each model, mode (``train``: ``zero_grad; loss.backward(); step`` of SGD; ``infer``:
eval mode under ``torch.no_grad``) and precision (``float32``; ``bfloat16``: parameters and
inputs in bf16; ``amp``: float32 parameters under ``torch.autocast(bfloat16)``), each
column reports pass/fail with the reason, its first call (s), its step (median ms), its
peak memory (MB, CUDA) and its accuracy.

Accuracy is checked as the harness checks it: a float64 eager run is the reference, and a
column's result, loss and every gradient must be as close to it as eager's own at the same
precision is (relative RMS error at most 3x eager's, a floor by precision, or what nudges of
round-off's size make eager's error, NOTE [conditioning]); a model that
does not run in float64 is compared with eager at the same precision, within the floor. Dropout is
off for that check, so every column computes the same step; with ``--dropout-seeds N`` the
model's own default dropout is then checked by distribution: the training loss over N seeds,
plait's against eager's (mean within four standard errors).

    .venv/bin/python benchmarks/suite.py [--device cpu|cuda] [--models A,B | --source timm]
        [--modes train,infer] [--dtypes float32,bfloat16,amp] [--columns eager,plait]
        [--slice I/N] [--csv FILE] [--fresh] [--size tiny|full] [--rounds N]
        [--dropout-seeds N] [--channels-last] [--report DIR]

On the CPU the models are tiny (two layers, narrow widths, small images and sequences,
batches of 2 sequences or 4 images); with ``--device cuda`` they are the harness's sizes and
batches (``--size`` picks either anywhere: tiny on CUDA checks the GPU's kernels across the
suite quickly; ``--rounds 0`` leaves out the timing). Results are appended to the CSV a model at a time, and models already there are skipped, so a run can
be resumed or split over several processes (``--slice 0/2``, ``--slice 1/2``);
``--report DIR`` writes the CSV's markdown table and a chart of plait's speed over
torch.compile's per model. ``--channels-last`` runs each model and its images in
channels-last memory (``model.to(memory_format=torch.channels_last)``, as vision training
scripts do), its rows named ``MODEL:channels_last``.
"""
from __future__ import annotations

import copy
import csv
import dataclasses
import gc
import math
import os
import statistics
import sys
import time
import traceback

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from suite_models import SUITE  # noqa: E402

COLUMNS = ("eager", "torch.compile", "plait")
PRECISION = {"float32": torch.float32, "bfloat16": torch.bfloat16, "amp": torch.float32}
# eager runs nudged by round-off, and by how many units of their precision (NOTE
# [conditioning]): eager's own activations are off by 1e-6..1e-5 in float32
NUDGES, NUDGE_ULPS = 3, 8
FLOOR = {"float32": 1e-4, "bfloat16": 2e-2, "amp": 2e-2}  # relative RMS error allowed anyway


@dataclasses.dataclass
class Row:
    model: str
    source: str
    mode: str
    dtype: str
    column: str
    status: str  # "pass", "wrong" (an answer off the reference), "fail" (raised)
    reason: str = ""
    first_s: float = math.nan
    step_ms: float = math.nan
    peak_mb: float = math.nan
    accuracy: float = math.nan  # the worst error over what is allowed: at most 1 passes


def without_dropout(module: torch.nn.Module) -> None:
    """Turn off every dropout of ``module``: the ``p`` of its dropout and stochastic-depth
    modules (torch's, torchvision's ``StochasticDepth``) and the float attributes named for
    dropout that models read when they call ``F.dropout`` themselves (transformers'
    attention modules, their configs; timm's ``drop_path`` rates)."""
    for m in module.modules():
        dropping = any(w in type(m).__name__ for w in ("Drop", "Stochastic"))
        for obj in (m, getattr(m, "config", None)):
            for name, value in list(vars(obj).items()) if obj is not None else ():
                if isinstance(value, float) and ("drop" in name or dropping and name == "p"):
                    setattr(obj, name, 0.0)


def _cast(inputs: dict, dtype: torch.dtype) -> dict:
    return {k: v.to(dtype) if v.is_floating_point() else v for k, v in inputs.items()}


class Step:
    """One column's model and its call: ``step()`` runs a training step or an inference
    call and returns ``(result, loss)``."""

    def __init__(self, module, column, mode, dtype, inputs, device, precision=None):
        import plait

        precision = precision or PRECISION[dtype]
        self.module, self.mode = module.to(precision), mode
        self.run = {"eager": lambda m: m, "torch.compile": torch.compile,
                    "plait": plait.jit}[column](module)
        self.inputs = _cast(inputs, precision)
        self.opt = torch.optim.SGD(module.parameters(), lr=0.0) if mode == "train" else None
        self.autocast = torch.autocast(device, dtype=torch.bfloat16, enabled=dtype == "amp")

    def __call__(self):
        if self.opt is None:
            with torch.no_grad(), self.autocast:
                return self.run(**self.inputs)
        self.opt.zero_grad(set_to_none=True)
        with self.autocast:
            result, loss = self.run(**self.inputs)
        loss.backward()
        self.opt.step()
        return result, loss

    def outputs(self, result, loss) -> dict:
        """What the accuracy check compares: the result, the loss and every gradient."""
        got = {"result": result.detach(), "loss": loss.detach()}
        if self.mode == "train":
            got.update((k, p.grad) for k, p in self.module.named_parameters()
                       if p.grad is not None)
        return got


def _rms(x: torch.Tensor) -> float:
    return x.double().pow(2).mean().sqrt().item()


def relative_error(got: torch.Tensor, want: torch.Tensor, floor: float = 0.0) -> float:
    """RMS(got - want) over RMS(want), or over ``floor`` where that is larger."""
    error = _rms(got.to(want.device).double() - want.double())
    scale = max(_rms(want), floor)
    return error / scale if scale > 0 else error


def accuracy(got: dict, eager: dict, nudged: list[dict], reference: dict,
             dtype: str) -> tuple[float, str]:
    """The worst of ``got``'s errors against the float64 ``reference``, as a multiple of what
    is allowed, and the tensor it was found in. Allowed: 3x eager's error on that tensor at
    the same precision, the precision's floor, or the largest error that eager runs
    ``nudged`` by round-off show on any tensor (NOTE [conditioning])."""
    if got.keys() != reference.keys():
        missing = sorted(set(reference) ^ set(got))[:3]
        return math.inf, f"gradients given or not: {missing}"
    # errors relative to a hundredth of the largest gradient's scale where a gradient is
    # zero in exact arithmetic (a key projection's bias: softmax ignores what it adds; a
    # question-answering head's bias: each row's probabilities minus its one-hot sum to 0).
    # What is left of such a sum is round-off of the terms that cancelled: with float32's
    # floor, a few of their ulps are allowed (a thousandth allowed about one: BERT's QA bias,
    # 3e-8 where eager's is 7e-9, failed)
    floor = 1e-2 * max((_rms(w) for k, w in reference.items() if k not in ("result", "loss")
                        and torch.isfinite(w).all()), default=0.0)
    compared = {k: (w, 0.0 if k in ("result", "loss") else floor)
                for k, w in reference.items() if torch.isfinite(w).all()}  # else it overflows
    spread = max((relative_error(n[k], w, scale) for n in nudged
                  for k, (w, scale) in compared.items()), default=0.0)
    worst, where = 0.0, ""
    for key, (want, scale) in compared.items():
        allowed = max(3 * relative_error(eager[key], want, scale), FLOOR[dtype], spread)
        ratio = relative_error(got[key], want, scale) / allowed
        if not ratio <= worst:  # NaN included
            worst, where = ratio, key
    return worst, where


def _sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


CHANNELS_LAST = ":channels_last"  # the rows' model name, run in channels-last memory


def in_channels_last(module, inputs: dict):
    """``module`` and its 4-D inputs in channels-last memory, as vision training scripts
    run them."""
    return module.to(memory_format=torch.channels_last), {
        k: v.contiguous(memory_format=torch.channels_last)
        if isinstance(v, torch.Tensor) and v.ndim == 4 else v for k, v in inputs.items()}


def run(name: str, mode: str, dtype: str, device: str, columns=COLUMNS, tiny: bool = True,
        rounds: int = 3, repeat: int = 5, dropout_seeds: int = 0,
        channels_last: bool = False) -> list[Row]:
    """One model's rows: every column's status, first call, step time, peak memory and
    accuracy for ``mode`` at ``dtype`` (``rounds=0``: no timing, the accuracy alone); with
    ``channels_last``, the model's parameters and its 4-D inputs in that memory format."""
    spec = SUITE[name]
    torch.manual_seed(0)
    base = spec.build(tiny).to(device)
    base.train(mode == "train")
    generator = torch.Generator().manual_seed(0)
    inputs = spec.inputs(base, spec.tiny_batch if tiny else spec.batch, tiny, device, generator)
    if channels_last:
        base, inputs = in_channels_last(base, inputs)
        name += CHANNELS_LAST
    dropout_base = copy.deepcopy(base) if dropout_seeds and mode == "train" else None
    without_dropout(base)
    torch._dynamo.reset()
    gc.collect()  # the last model's columns (a cycle keeps a jitted module, its CUDA graphs)

    want = _reference(base, mode, inputs, device)
    if device == "cuda":  # what CUDA graphs hold already is not this model's
        from plait.backends.cuda_graphs import held_bytes

        held_before = held_bytes()

    rows, steps, eager_outputs, nudged = [], [], None, []
    for column in ("eager",) + tuple(c for c in columns if c != "eager"):
        row = Row(name, spec.source, mode, dtype, column, "pass")
        try:
            step = Step(copy.deepcopy(base), column, mode, dtype, inputs, device)
            torch.manual_seed(0)  # any draw left (a model's own) alike in every column
            start = time.perf_counter()
            got = step.outputs(*step())
            _sync(device)
            row.first_s = time.perf_counter() - start
            if column == "eager":
                want = want or got
                eager_outputs = got
            row.accuracy, where = accuracy(got, eager_outputs, nudged, want, dtype)
            if not row.accuracy <= 1 and not nudged:  # ill-conditioned? (NOTE [conditioning])
                nudged = [_nudged(base, mode, dtype, inputs, device, seed)
                          for seed in range(NUDGES)]
                row.accuracy, where = accuracy(got, eager_outputs, nudged, want, dtype)
            if not row.accuracy <= 1:
                row.status, row.reason = "wrong", f"{where} off the float64 reference " \
                                                  f"({row.accuracy:.3g}x what is allowed)"
            if rounds:
                for _ in range(3):  # warm (plait captures CUDA graphs from its third call)
                    step()
                steps.append((row, step, []))
        except Exception as e:  # noqa: BLE001 - a column's failure is a result
            row.status, row.reason = "fail", _failure(e)
        if column in columns:
            rows.append(row)
    _time(steps, device, rounds, repeat)
    for row, step, _ in steps:
        if device == "cuda":
            from plait.backends.cuda_graphs import held_bytes
            from models import peak_bytes

            graphs = held_bytes() - held_before if row.column == "plait" else 0
            row.peak_mb = peak_bytes(step, device, graphs) / 2 ** 20
    if dropout_base is not None:
        _check_dropout(rows, dropout_base, spec, inputs, dtype, device, dropout_seeds)
    return rows


def _reference(module, mode, inputs, device) -> dict | None:
    """The float64 eager run's outputs, or None for a model that runs in float32 alone
    (XGLM's ``torch.full`` of float64's min): then eager's own are the reference."""
    try:
        step = Step(copy.deepcopy(module), "eager", mode, "float32", inputs, device,
                    torch.float64)
        torch.manual_seed(0)
        return step.outputs(*step())
    except Exception:  # noqa: BLE001
        return None


def _nudged(module, mode, dtype, inputs, device, seed: int) -> dict:
    """Eager's outputs after its parameters and inputs are moved by a few units of their
    precision (``NUDGE_ULPS``, relative): how far round-off alone can take this model.

    NOTE [conditioning]: a training step through BatchNorm over a few elements and ReLU is
    ill-conditioned: a pre-activation within round-off of zero flips its ReLU's mask, and
    gradients move by 1e-2 where eager's own error happens to be 1e-5 (densenet121, tiny).
    Whether a rounding flips a mask is luck, and which tensors it moves is luck too, so
    eager's error on each tensor is no yardstick there. The largest error that a few
    nudges of round-off's size make on any tensor measures how far round-off can take the
    model, and is allowed on every tensor: tight for a well-conditioned model, loose only
    for an ill-conditioned one (where plait in float64 agrees with eager in float64). A
    nudge is 8 units of the precision, as eager's activations deep in a model are off by
    1e-6..1e-5 in float32; at one unit, ghostnet's flip (the same gradient, moved as far as
    plait's) appeared in one nudge of four."""
    step = Step(copy.deepcopy(module), "eager", mode, dtype, inputs, device)
    generator = torch.Generator(device).manual_seed(seed)

    def nudged(t):
        if not t.is_floating_point():
            return t
        noise = torch.randn(t.shape, generator=generator, device=t.device, dtype=t.dtype)
        return t * (1 + NUDGE_ULPS * torch.finfo(t.dtype).eps * noise)

    with torch.no_grad():
        for p in step.module.parameters():
            p.copy_(nudged(p))
    step.inputs = {k: nudged(v) for k, v in step.inputs.items()}
    torch.manual_seed(0)
    return step.outputs(*step())


def _time(steps, device, rounds, repeat):
    """Each column's steps in turn, round after round, so that the machine's drift reaches
    every column alike; each row's step is the median."""
    for _ in range(rounds):
        for _, step, times in steps:
            for _ in range(repeat):
                start = time.perf_counter()
                step()
                _sync(device)
                times.append((time.perf_counter() - start) * 1e3)
    for row, _, times in steps:
        row.step_ms = statistics.median(times)


def _failure(e: Exception) -> str:
    """A failed column's reason: refused (plait's error) or the exception's type, and its
    first line; with PLAIT_SUITE_TRACEBACK=1 the traceback is printed too."""
    import plait

    if os.environ.get("PLAIT_SUITE_TRACEBACK"):
        traceback.print_exc()
    kind = "refused" if isinstance(e, plait.errors.PlaitError) else type(e).__name__
    return f"{kind}: {str(e).strip().splitlines()[0][:200] if str(e).strip() else ''}"


def _check_dropout(rows, module, spec, inputs, dtype, device, seeds):
    """With the model's own dropout, plait's training loss over ``seeds`` seeds against
    eager's: the means agree within four standard errors (a wrong distribution is a wrong
    answer even where every value check passes)."""
    has_dropout = any(isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0
                      for m in module.modules())
    row = next((r for r in rows if r.column == "plait"), None)
    if not has_dropout or row is None or row.status != "pass":
        return
    losses = {}
    for column in ("eager", "plait"):
        losses[column] = []
        try:
            step = Step(copy.deepcopy(module), column, "train", dtype, inputs, device)
            for seed in range(seeds):
                torch.manual_seed(seed)
                losses[column].append(step()[1].item())
        except Exception as e:  # noqa: BLE001 - plait's failure with dropout is its row's
            if column == "eager":
                raise
            row.status, row.reason = "fail", "with dropout, " + _failure(e)
            return
    (e_mean, e_var), (p_mean, p_var) = [(statistics.mean(v), statistics.variance(v))
                                        for v in losses.values()]
    bound = 4 * math.sqrt((e_var + p_var) / seeds) + 1e-6 * abs(e_mean)
    if abs(p_mean - e_mean) > bound:
        row.status = "wrong"
        row.reason = (f"dropout's distribution: mean training loss {p_mean:.5g} over "
                      f"{seeds} seeds, eager's {e_mean:.5g} (bound {bound:.2g})")


# ---------------------------------------------------------------------------------------
# results: the CSV, the markdown table and the chart
# ---------------------------------------------------------------------------------------
FIELDS = [f.name for f in dataclasses.fields(Row)]


def read_rows(path: str) -> list[Row]:
    if not os.path.exists(path):
        return []
    with open(path, newline="") as f:
        return [Row(**{k: (float(v) if k in ("first_s", "step_ms", "peak_mb", "accuracy")
                           else v) for k, v in r.items()}) for r in csv.DictReader(f)]


def append_rows(path: str, rows: list[Row]) -> None:
    append_csv(path, [dataclasses.asdict(r) for r in rows], FIELDS)


def append_csv(path: str, rows: list[dict], fields=None) -> None:
    """Append ``rows`` to the CSV file ``path``, its header first where the file is new."""
    new = not os.path.exists(path)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "a", newline="") as f:
        writer = csv.DictWriter(f, fields or list(rows[0]))
        if new:
            writer.writeheader()
        writer.writerows(rows)


def _geomean(values):
    values = [v for v in values if v > 0 and math.isfinite(v)]
    return math.exp(statistics.mean(map(math.log, values))) if values else math.nan


def report(rows: list[Row], directory: str, device: str) -> None:
    """``suite-<device>.md``: per mode and precision, a table of every model's columns and
    the geometric means; ``suite-<device>.svg``: plait's speed over torch.compile's per
    model, sorted."""
    os.makedirs(directory, exist_ok=True)
    lines, speedups = [f"# The model suite on {device}", ""], []
    groups = sorted({(r.mode, r.dtype) for r in rows})
    for mode, dtype in groups:
        group = [r for r in rows if (r.mode, r.dtype) == (mode, dtype)]
        models = sorted({r.model for r in group})
        cols = [c for c in COLUMNS if any(r.column == c for r in group)]
        by = {(r.model, r.column): r for r in group}
        lines += [f"## {mode}, {dtype}", "",
                  "| model | " + " | ".join(f"{c} ms (first s, MB)" for c in cols)
                  + " | plait vs tc | plait vs eager | plait |",
                  "|---|" + "--:|" * (len(cols) + 2) + "---|"]
        ratios = {"tc": [], "eager": []}
        for model in models:
            cells = []
            for c in cols:
                r = by.get((model, c))
                cells.append("-" if r is None or r.status == "fail" else
                             f"{r.step_ms:.2f} ({r.first_s:.1f}, {r.peak_mb:.0f})")
            p = by.get((model, "plait"))
            tc, eager = by.get((model, "torch.compile")), by.get((model, "eager"))
            ok = p is not None and p.status == "pass"
            vs = {}
            for key, other in (("tc", tc), ("eager", eager)):
                vs[key] = other.step_ms / p.step_ms if ok and other is not None and \
                    other.status == "pass" else math.nan
                if math.isfinite(vs[key]):
                    ratios[key].append(vs[key])
            if math.isfinite(vs["tc"]):
                speedups.append((f"{model} ({mode}, {dtype})", vs["tc"]))
            status = "pass" if ok else ("-" if p is None else f"{p.status}: {p.reason}")
            lines.append(f"| {model} | " + " | ".join(cells) +
                         f" | {vs['tc']:.2f}x | {vs['eager']:.2f}x | {status} |")
        passed = sum(1 for m in models if by.get((m, "plait")) and
                     by[(m, "plait")].status == "pass")
        runs = sum(1 for m in models if by.get((m, "eager")) and
                   by[(m, "eager")].status == "pass")
        lines += ["", f"plait passes {passed} of the {runs} models eager runs; geometric "
                  f"mean {_geomean(ratios['tc']):.2f}x torch.compile, "
                  f"{_geomean(ratios['eager']):.2f}x eager.", ""]
    with open(os.path.join(directory, f"suite-{device}.md"), "w") as f:
        f.write("\n".join(lines))
    _chart(sorted(speedups, key=lambda s: s[1]),
           os.path.join(directory, f"suite-{device}.svg"))


def _chart(speedups, path):
    """A horizontal bar per model: plait's step time over torch.compile's, with 1x marked."""
    bar, left, width = 14, 330, 400
    top = max([s for _, s in speedups] + [1.5])
    out = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{left + width + 60}" '
           f'height="{bar * len(speedups) + 40}" font-family="sans-serif" font-size="10">']
    for i, (label, s) in enumerate(speedups):
        y, w = 20 + i * bar, width * s / top
        color = "#2a7" if s >= 1 else "#d53"
        out += [f'<text x="{left - 4}" y="{y + 10}" text-anchor="end">{label}</text>',
                f'<rect x="{left}" y="{y + 2}" width="{w:.1f}" height="{bar - 4}" '
                f'fill="{color}"/>',
                f'<text x="{left + w + 3:.1f}" y="{y + 10}">{s:.2f}x</text>']
    one = left + width / top
    out += [f'<line x1="{one:.1f}" y1="12" x2="{one:.1f}" y2="{20 + bar * len(speedups)}" '
            'stroke="#000" stroke-dasharray="3"/>',
            '<text x="4" y="12">plait speed over torch.compile (step time ratio)</text>',
            "</svg>"]
    with open(path, "w") as f:
        f.write("\n".join(out))


def main() -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    parser.add_argument("--models", default="", help="comma-separated names (default all)")
    parser.add_argument("--source", default="", help="transformers, timm or torchvision")
    parser.add_argument("--modes", default="train,infer")
    parser.add_argument("--dtypes", default=None,
                        help="default float32 on the CPU, bfloat16 on CUDA")
    parser.add_argument("--columns", default=",".join(COLUMNS))
    parser.add_argument("--slice", default="0/1", help="I/N: every N-th model from the I-th")
    parser.add_argument("--csv", default=None, help="default benchmarks/results/suite-DEV.csv")
    parser.add_argument("--fresh", action="store_true", help="run models already in the CSV")
    parser.add_argument("--size", default=None, choices=("tiny", "full"),
                        help="default tiny on the CPU, the harness's (full) on CUDA")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--dropout-seeds", type=int, default=0)
    parser.add_argument("--channels-last", action="store_true",
                        help="models and images in channels-last memory")
    parser.add_argument("--report", default=None, help="write the table and chart here")
    args = parser.parse_args()

    from models import fresh_caches

    fresh_caches(args.device)
    here = os.path.dirname(os.path.abspath(__file__))
    path = args.csv or os.path.join(here, "results", f"suite-{args.device}.csv")
    names = args.models.split(",") if args.models else \
        [n for n, m in SUITE.items() if args.source in ("", m.source)]
    index, count = map(int, args.slice.split("/"))
    names = names[index::count]
    columns = tuple(args.columns.split(","))
    dtypes = (args.dtypes or ("float32" if args.device == "cpu" else "bfloat16")).split(",")
    done = {(r.model, r.mode, r.dtype) for r in read_rows(path)} if not args.fresh else set()
    suffix = CHANNELS_LAST if args.channels_last else ""
    for name in names:
        for mode in args.modes.split(","):
            for dtype in dtypes:
                if (name + suffix, mode, dtype) in done:
                    continue
                start = time.perf_counter()
                try:
                    tiny = (args.size or ("tiny" if args.device == "cpu" else "full")) == "tiny"
                    rows = run(name, mode, dtype, args.device, columns, tiny, args.rounds,
                               args.repeat, args.dropout_seeds, args.channels_last)
                except Exception as e:  # noqa: BLE001 - building it, or its inputs
                    rows = [Row(name + suffix, SUITE[name].source, mode, dtype, "eager", "fail",
                                f"{type(e).__name__}: {str(e)[:200]}")]
                append_rows(path, rows)
                cells = "  ".join(
                    f"{r.column} {r.status.upper()} ({r.reason[:80]})" if r.status != "pass"
                    else f"{r.column} {r.step_ms:.2f} ms" if args.rounds
                    else f"{r.column} pass" for r in rows)
                seconds = time.perf_counter() - start
                print(f"{name}{suffix} {mode} {dtype} [{seconds:.0f} s]: {cells}", flush=True)
    if args.report:
        report(read_rows(path), args.report, args.device)


if __name__ == "__main__":
    main()
