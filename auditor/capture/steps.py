"""The steps of a whole program (`audit run file.py`), found without the user's help.

A step is one iteration of the training loop, as a person counts it:
- its optimizer steps (every torch.optim.Optimizer, through torch's global step hook, and
  `GradScaler.step`, which skips the optimizer's step on inf gradients) mark its end; several
  optimizers stepped in one iteration (a GAN's D and G) are one step, and gradient-accumulation
  micro-batches belong to the step they accumulate into (a step closes only after an optimizer
  step, once every optimizer seen stepping has stepped in it; one the program has let go of, its
  `del optimizer` or its name rebound to the next stage's, is not waited for, nor is one stepped
  in some iterations only: where an optimizer steps again in the open step, on a new backward
  pass, and the innermost loop that holds its step holds the step of one that has not stepped
  (TD3's actor every second iteration, a WGAN-GP generator every n-th batch), that one is left
  out of the optimizers a step waits for; a WGAN critic's inner loop of updates holds no
  generator step, and stays in its generator's step);
- the step closes at the first activity after its last optimizer step that begins an iteration: the next fetch of the
  training DataLoader (the loader fetched last before an optimizer step) through the loop's
  iterator (another iterator of it, made while the loop's lives and has batches left, fetches as
  another loader does: an evaluation that reads training batches mid-epoch), which then begins the
  next step, timed from the fetch's start; where no training DataLoader is known, the next
  outermost backward pass or module forward run with grad enabled. Forwards under no_grad after
  the optimizer step (gat's evaluation of train and validation accuracy each epoch, an LBFGS
  program's prediction, an agent's next action; each counted at its outermost module call) are the
  iteration's own work and stay in its step: one always, and up to as many as the previous step's
  tail held or the most any step of its loop held (the first step's tail is unbounded and not
  counted, and so is a step that steps an optimizer first seen after the first step: a new loop,
  whose tail is its own). One more (a final test after
  the loop, an evaluation every k steps) closes the step and begins none, and what runs until
  the next iteration is outside the steps ("between"). A fetch of another loader after an optimizer step
  (an eval loop) closes the step too and begins none: what runs until the next training fetch is
  outside the steps ("between"). With a training DataLoader, forwards and backwards never close a
  step, which keeps a GAN's D and G in one;
- a fetch of the training DataLoader that closes a step and finds the loader exhausted begins none;
  where the loop then trains on a batch fetched before it (a wrapper that fetches one ahead: timm's
  PrefetchLoader, accelerate's loader, whose last batch comes after the loader's end), the optimizer
  step that ends that iteration (a backward pass ran since the last) begins its step at that fetch,
  back in time: its forward and backward are the step's, not work between steps;
- where no optimizer has stepped and no training DataLoader is known, a weight update outside
  torch.optim (`p.data.add_(p.grad, alpha=-lr)` over the parameters: pytorch/examples'
  word_language_model) marks steps: a forward with grad enabled after the step's backward pass
  closes the step and begins the next when the module's weights changed since the step's first
  forward (their version counters, which an in-place update under no_grad moves, or their norms,
  which an update through `.data` changes: a fingerprint taken and compared while the finder is
  telling updates apart, see StepFinder._updated). Where they did not change, the forward is a
  gradient-accumulation micro-batch of the open step (an optimizer may step after several). Once
  UPDATES_TO_TRUST updates have been seen and no micro-batch, every forward after a backward
  pass closes its step, unchecked; a DataLoader's fetch then begins it. A program of plain
  tensors, with no module forward to read (pytorch/tutorials' polynomial_autograd: `a -= lr *
  a.grad` under no_grad), is read at its backward passes instead: one whose leaves (those the
  pass before it reached) changed since that pass closes the step and begins the next; one whose
  leaves did not (a second loss, a micro-batch) stays in it;
- where no optimizer steps, the first DataLoader fetched marks steps: each of its fetches in a
  step without a backward pass closes the step and begins the next, once the step has done
  something besides fetching (a wrapper that fetches one batch ahead, as accelerate's loader in
  a Hugging Face Trainer does, fetches twice before its first forward pass: one step; a sampler's
  iteration, and the batch's copy to the device and elementwise ops on it in the function that
  fetched it, as timm's PrefetchLoader normalises it, are fetching). A step
  with a backward pass is closed by a fetch only in a program that never makes an optimizer
  (`makes_no_optimizer`: a custom update, `w -= lr * w.grad`): elsewhere, before its first
  optimizer step is seen, a gradient-accumulation micro-batch looks the same;
- one optimizer updating REPEATS_TO_SPLIT times in one open step, each time on a backward pass of
  its own, shows a boundary missed: a batch fetched once and trained on for epochs
  (pytorch/examples mnist_forward_forward: `x, y = next(iter(loader))`, then a thousand updates
  of each layer) makes no training DataLoader (its loader is not taken for one again), and the
  optimizers that did not step meanwhile have stopped (that program's layers, each with an Adam
  of its own, trained one after another): from there each update ends a step, and the next pass
  begins the next. The step that showed it holds its REPEATS_TO_SPLIT + 1 updates;
- a forward or backward pass before the first step, in a program that may make an optimizer and
  has made a DataLoader and not fetched from it yet, is its setup (a style image's features, a sanity check's dummy batch):
  it begins no step; the loop's first fetch does (where an optimizer steps first, the loop never
  fetches: its first step holds those passes). So is a fetch under no_grad before the first step
  in such a program, and the passes after it (an evaluation before training);
- `auditor.step()` calls, once one is seen, are the only boundaries: each ends the open step and
  begins the next;
- the program's end closes an open step that has its ending (an optimizer step, or a DataLoader
  iteration); one that does not (what follows the last marker or optimizer step) is dropped, its
  work counted as what ran "after".
Steps are counted from the program's first one; the first `skip` run unaudited (not recorded, no
profiling), the next `steps` are audited, and then (unless `to_end`) `StepsDone` is raised at the
boundary, which ends the program as a Ctrl-C does.
"""
from __future__ import annotations

import ast
import re
import sys
import threading
import time
import weakref
from typing import Any, Callable

import torch
import torch.utils.data.dataloader as dl
from torch.nn.modules import module as nn_module

from auditor import step_marker
from auditor.capture import probes, step_loops, wire
from auditor.capture.frames import user_frame
from auditor.capture.one_call import OneCall
from auditor.capture.probes.workers import GONE_LOADERS
from auditor.capture.session import StepSession
from auditor.capture.unseen import no_torch_function, quietly, threads_end_quietly
from auditor.evidence import model as m

_CALL_IMPL = nn_module.Module._call_impl.__code__


def _nested_call(frame: Any) -> bool:
    """Whether the module call whose forward pre-hook runs below `frame` is made inside another
    module's call: its own Module._call_impl is the first on the stack, an outer call's is further
    up. (The global pre-hook sees every module's call; a pass is the outermost one.)"""
    seen = False
    while frame is not None:
        if frame.f_code is _CALL_IMPL:
            if seen:
                return True
            seen = True
        frame = frame.f_back
    return False


# what fetching a batch does (the loader's iterator made, its sampler iterated, its workers' batches,
# device tensors made inside the iteration): no work of a step besides fetching (_worked)
_DATA_KINDS = frozenset((m.DATA_WAIT, m.DATA_ITER, m.DATA_WORKER, m.SAMPLER_ITER, m.DATA_DEVICE_OP))
# a batch's preparation where it was fetched (its copy to the device, a stream for it, an elementwise op
# on it: timm's PrefetchLoader normalises each batch on the device as it fetches the next): fetching too,
# made in the function whose fetch began the step (_worked); a matmul or a forward there is work
_PREP_KINDS = frozenset((m.H2D_COPY, m.CUDA_STANDIN, m.DEVICE_LAUNCH))

_compiling = torch.compiler.is_compiling

# Updates of one optimizer in one open step, each on a backward pass of its own, before the finder
# takes the step's boundary for missed (see StepFinder._repeated): more than a critic's updates per
# batch (a WGAN's five), far fewer than a batch trained on for epochs.
REPEATS_TO_SPLIT = 16

UNPROBED_STRETCH_MS = 1.0  # an unprobed stretch between steps this long is the program's (a sleep, a log)
# Weight updates outside torch.optim seen before the finder stops checking each one (see
# StepFinder._updated): past this many, with no micro-batch between them, the program's every
# forward after a backward pass is an iteration's start.
UPDATES_TO_TRUST = 3

# Backward passes whose leaves are compared with the pass before them, without an update found,
# before the finder stops comparing (a program that trains no leaves it reaches), and the graph
# nodes one walk reads at most (a program of plain tensors has a small graph; a model's is read at
# its forward instead)
LEAF_CHECKS = 50
LEAF_NODES = 20_000

# Names in a program's code that make or step an optimizer: torch.optim and its optimizers, those
# of other libraries (bitsandbytes.optim, timm's create_optimizer), GradScaler, and the frameworks
# that make theirs (a Trainer, accelerate's Accelerator, Lightning, DeepSpeed, Fabric ...).
_OPTIMIZER_NAMES = re.compile(r"optim|adam|sgd|rmsprop|adagrad|adadelta|lbfgs|gradscaler|trainer|lightning|"
                              r"deepspeed|fairscale|^accelerate$|^Accelerator$|^Fabric$|^(composer|ignite)$", re.I)


def makes_no_optimizer(file: str | None, module: str | None = None) -> bool:
    """Whether the program's own modules (the target and the user's modules it imports, read as
    rehearsal reads them for CUDA, before anything runs) never name an optimizer: no identifier,
    imported name or string matching _OPTIMIZER_NAMES. False when any of them cannot be read
    (a zip file, a .pyc): it may make one."""
    from auditor.capture.rehearsal.intent import program_trees

    any_read = False
    for path, tree in program_trees(file, module):
        if tree is None or not path.endswith(".py"):
            return False
        any_read = True
        for node in ast.walk(tree):
            if isinstance(node, ast.Name):
                names = [node.id]
            elif isinstance(node, ast.Attribute):
                names = [node.attr]
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names = [node.name]
            elif isinstance(node, ast.alias):
                names = [*node.name.split("."), node.asname or ""]
            elif isinstance(node, ast.ImportFrom):
                names = (node.module or "").split(".")
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and len(node.value) < 200:
                names = re.split(r"[^\w]+", node.value)
            else:
                continue
            if any(n and _OPTIMIZER_NAMES.search(n) for n in names):
                return False
    return any_read


class StepsDone(KeyboardInterrupt):
    """Raised at the step boundary after the last audited step (--steps N): ends the program the way
    a Ctrl-C does, so that its `finally` blocks, context managers and atexit handlers run."""


class StepFinder:
    """Marks a running program's steps on `session` (see the module's docstring).

    rec: the probes' Recorder; steps/skip/to_end: the audit's --steps, --skip, --to-end;
    send: the evidence Writer's send; send_setup: sends the setup record (called once, when the
    first step begins or the program ends without one); no_optimizer: the program never makes
    an optimizer (makes_no_optimizer), so DataLoader fetches close steps with a backward pass too."""

    def __init__(self, session: StepSession, rec: Any, send: Callable[..., None], steps: int, skip: int,
                 to_end: bool, send_setup: Callable[[], None], no_optimizer: bool = False) -> None:
        self.session, self.rec, self.send = session, rec, send
        self.no_optimizer = no_optimizer
        self.steps, self.skip, self.to_end = steps, skip, to_end
        self.send_setup = send_setup
        self.setup_sent = False
        self.iteration: int | None = None  # the open step, counted from the program's first (skipped too)
        self.begun = 0  # steps begun
        self.recorded = 0  # audited steps ended
        self.last_audited: int | None = None  # the audited index of the last recorded step
        self.pending = False  # the open step has its ending: its next activity closes it
        self.opts_in_step: set[int] = set()
        self.known_opts: set[int] = set()  # every optimizer seen stepping, but the occasional ones
        self.occasional: set[int] = set()  # optimizers stepped in some iterations only (_skipped_by)
        self.step_lines: dict[int, Any] = {}  # optimizer -> the user's line that stepped it first
        self.opt_names: dict[str, int] = {}  # optimizer class -> its steps in audited steps
        self.opt_calls = 0  # optimizer steps in audited steps
        self.opts_per_step: dict[int, int] = {}  # optimizers stepped in one audited step -> steps that stepped so many
        self.backward_in_step = False
        self.backward_since_update = False  # a backward pass ran since the last optimizer step
        self.repeats = 0  # updates in the open step of an optimizer that had already stepped in it
        self.not_training: set[int] = set()  # loaders found not to drive the loop (_repeated)
        self.setup_passes = False  # passes before the first step ran as setup (_setting_up), not sent yet
        self.tail_passes = 0  # no-grad forwards after the open step's optimizer step
        self.tail_limit: int | None = None  # the tail the next step may hold (None: unbounded, _tail_held)
        self.tail_most = 0  # the most no-grad forwards a step of this loop held in its tail (its first aside)
        self.loop_start = 0  # the first step of the loop (a new optimizer after the first step begins one)
        self.in_tail_outside = False  # a tail past its limit closed the step: no-grad forwards begin none
        self.fingerprint: tuple | None = None  # the open step's first forward's module and weights (_fingerprint)
        self.leaves: tuple | None = None  # the leaves the open step's last backward pass reached (_leaf_fingerprint)
        self.leaf_checks = 0  # backward passes compared with the last since an update was seen
        self.by_leaves = False  # an update was found at a backward pass, by its leaves (_leaves_updated)
        self.updates_seen = 0  # weight updates outside torch.optim seen (forwards after a backward that found them changed)
        self.micro_seen = False  # a forward after a backward found the weights unchanged: a micro-batch
        self.optimizer_begun = False  # an optimizer step has begun (_optimizer_begins)
        self._begins_hook: Any = None  # its handle, removed once it has fired
        self.first_loader: int | None = None
        self.last_loader: int | None = None
        self.train_loader: int | None = None
        # the iterator whose fetch began the open step (or the last one), until it is exhausted:
        # another iterator of the training loader fetching while it lives is no fetch of the loop's
        self.train_iter: weakref.ref | None = None
        # (t0, c0) of a fetch that crossed a boundary and found the loader exhausted, until the next
        # step begins or another fetch runs: the batch a wrapper fetched ahead may still be trained on
        self.ran_out_at: tuple[float, float] | None = None
        self.fetched_in: tuple[str, str] | None = None  # (file, function) whose fetch began the open step
        self.mode: str | None = None  # "optimizer" | "dataloader" | "marker" once known
        self.done = False  # the audit's steps are done, or the program ended: no more steps
        self.stopped = False  # StepsDone was raised: the audit ended the program after its steps
        self.busy = False  # inside a boundary (the auditor's own work there is no activity)
        self.outside_t0 = time.perf_counter()
        self.main_thread = threading.get_ident()
        self._fwd_hook: Any = None  # the forward pre-hook's handle, once registered
        self._fwd_on = False  # it is in torch's dict (or out of it for a no-grad pass's calls: _tail_call)
        self._tail_call = OneCall()
        self._undo: list[Callable[[], None]] = []

    # -- installation --------------------------------------------------------------------------

    def install(self) -> None:
        """Hook the activities that mark steps. Installed after the probes, so these wrappers are
        outermost: a boundary is crossed before a probe times the call that crossed it."""
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        h = register_optimizer_step_post_hook(lambda opt, args, kwargs: quietly(self.on_optimizer_step, opt))  # (untraced)
        self._undo.append(h.remove)
        self._begins_hook = register_optimizer_step_pre_hook(self._optimizer_begins)
        self._undo.append(self._drop_begins_hook)
        # an optimizer step inside code torch.compile compiled runs no Python hook: the probes note it
        # while tracing and hand it over once the compiled code has run (probes.settle_traced_steps)
        reader = lambda opt, where: self.on_optimizer_step(opt)  # noqa: E731
        probes.read_traced_steps(reader)
        self._undo.append(lambda: probes.unread_traced_steps(reader))
        self._wrap(dl._BaseDataLoaderIter, "__next__", self._fetch_probe)
        self._undo.append(probes.on_backward_start(self.on_backward))
        try:
            from torch.amp import GradScaler

            self._wrap(GradScaler, "step", self._scaler_probe)
        except ImportError:
            pass
        self._undo.append(step_marker.listen(self.on_marker))
        self._undo.append(threads_end_quietly(StepsDone, lambda: self.stopped))  # (steps on a thread)
        self._update_forward_hook()

    def uninstall(self) -> None:
        self._set_forward_hook(False)
        for undo in reversed(self._undo):
            undo()
        self._undo.clear()
        self._fwd_hook = None

    def _drop_begins_hook(self) -> None:
        if self._begins_hook is not None:
            self._begins_hook.remove()
            self._begins_hook = None

    def _wrap(self, owner: Any, name: str, make: Callable[[Callable], Callable]) -> None:
        orig = owner.__dict__[name] if name in getattr(owner, "__dict__", {}) else getattr(owner, name)
        wrapped = make(orig)
        try:
            wrapped.__wrapped__ = orig
            wrapped.__name__ = getattr(orig, "__name__", name)
            wrapped.__qualname__ = getattr(orig, "__qualname__", name)
            wrapped.__doc__ = getattr(orig, "__doc__", None)
        except (AttributeError, TypeError):
            pass
        setattr(owner, name, wrapped)
        self._undo.append(lambda: setattr(owner, name, orig))

    def _live(self) -> bool:
        """Whether step activity marks steps now: on the main thread, or the thread doing it before any step."""
        if self.done or self.busy or not self.rec.active or _compiling():
            return False
        if not self.begun:
            self.main_thread = threading.get_ident()
        return threading.get_ident() == self.main_thread

    # -- activities ----------------------------------------------------------------------------

    def _fetch_probe(self, orig: Callable) -> Callable:
        finder = self

        def __next__(it):
            if not finder._live() or finder.rec.in_data:
                return orig(it)
            if not finder.before_fetch(getattr(it, "_audit_loader_id", id(it)), it):
                return finder._next(orig, it)
            t0, c0 = time.perf_counter(), time.process_time()
            try:
                batch = finder._next(orig, it)  # (a StopIteration begins no step: the epoch is over)
            except StopIteration:
                finder.ran_out_at = (t0, c0)
                raise
            if not finder.done:
                finder._begin(t0, c0)
                if finder.mode in (None, "dataloader"):  # (the modes whose fetches read _worked)
                    where = user_frame(sys._getframe(1))  # (the user's function whose fetch began the step)
                    finder.fetched_in = (where[0], where[2]) if where is not None else None
                try:
                    finder.train_iter = weakref.ref(it)
                except TypeError:  # (an iterator without weak references: not told apart)
                    finder.train_iter = None
            return batch
        return __next__

    def _next(self, orig: Callable, it: Any) -> Any:
        try:
            return orig(it)
        except StopIteration:
            if self.train_iter is not None and self.train_iter() is it:
                self.train_iter = None  # (its epoch is over: the next iterator is the loop's)
            raise

    def _evaluating_first(self) -> bool:
        """Whether a fetch is an evaluation before training, part of the program's setup: one run
        under no_grad before the first step, in a program that may make an optimizer
        (LLMs-from-scratch's initial losses over 5 batches of each set, before its AdamW is made;
        a sanity check's validation batches). It begins no step, and its loader is not taken for
        the loop's: the passes after it are setup too (_setting_up)."""
        return self.begun == 0 and not self.no_optimizer and not torch.is_grad_enabled()

    def _side_fetch(self, loader: int, it: Any) -> bool:
        """A fetch of the training DataLoader through another iterator than the one the loop
        fetches from, while that one lives and has batches left: an evaluation that reads batches
        of the training set mid-epoch (LLMs-from-scratch's `calc_loss_loader(train_loader, ...)`
        every 5 steps), taken as a fetch of another loader: it begins no step."""
        if it is None or loader != self.train_loader or self.train_iter is None:
            return False
        current = self.train_iter()
        return current is not None and current is not it

    def on_backward(self, what: str, tensors: Any = None) -> None:
        """A backward pass of the user's code begins (autograd.grad, no pass of the step, aside)."""
        if what != "torch.autograd.grad" and self._live() and not self.rec.in_data:
            if self._leaves_watched():
                if (self.iteration is not None and self.backward_in_step and not self.pending
                        and self._leaves_updated()):
                    self.mode = "update"
                    self.pending = True  # (on_pass closes the step here and begins the next)
                if not self._trusting_updates():
                    self.leaves = self._leaf_fingerprint(tensors)
            self.on_pass()
            self.backward_in_step = True
            self.backward_since_update = True
            if self._watching_updates():
                self._update_forward_hook()

    def _scaler_probe(self, orig: Callable) -> Callable:
        finder = self

        def step(scaler, optimizer, *args, **kwargs):
            try:
                return orig(scaler, optimizer, *args, **kwargs)
            finally:  # (a step skipped on inf gradients still ends the iteration)
                finder.on_optimizer_step(optimizer)
        return step

    def before_fetch(self, loader: int, it: Any = None) -> bool:
        """A DataLoader fetch (through the iterator `it`) is about to run: cross a boundary if it is
        one. True when a step begins if the fetch returns a batch."""
        self._forget_gone_loaders()
        self.ran_out_at = None
        if self.mode != "marker" and self._evaluating_first():
            return False
        if self.first_loader is None:
            self.first_loader = loader
        self.last_loader = loader
        if self.mode == "marker":
            return False
        if self._side_fetch(loader, it):
            loader = -1  # (as another loader's: no id of an object is -1)
        if self.iteration is None:
            if self.train_loader is not None:
                starts = loader == self.train_loader
            elif self.mode == "dataloader":
                starts = loader == self.first_loader
            else:
                starts = True
            if starts:
                self._flush_outside()
            return starts
        if self.pending:
            starts = self.train_loader is None or loader == self.train_loader
            self._end()
            if starts:
                self._flush_outside()
            return starts
        if self.mode == "update" and self._trusting_updates() and loader == self.first_loader and self.backward_in_step:
            self._end()  # (an update-marked iteration begins at its batch's fetch)
            self._flush_outside()
            return True
        if (self.mode in (None, "dataloader") and not self.known_opts and loader == self.first_loader
                and (self.no_optimizer or not self.backward_in_step) and self._worked()):
            self.mode = "dataloader"
            self._end()
            self._flush_outside()
            return True
        return False

    def _forget_gone_loaders(self) -> None:
        """The loaders the program has let go of (freed: `train_dl = DataLoader(...)` rebound to the
        next stage's) mark no more steps: the next one fetched before an optimizer step takes over."""
        gone = GONE_LOADERS
        if not gone:
            return
        if self.train_loader in gone:
            self.train_loader = None
        if self.first_loader in gone:
            self.first_loader = None
        if self.last_loader in gone:
            self.last_loader = None
        self.not_training -= gone

    def _worked(self) -> bool:
        """Whether the open step has done anything the probes saw besides fetching batches (and
        preparing them where they were fetched: _PREP_KINDS)."""
        fetched_in = self.fetched_in
        return any(key[0] not in _DATA_KINDS and not (
            key[0] in _PREP_KINDS and fetched_in is not None and key[2] is not None
            and key[2][0] == fetched_in[0] and key[2][2] == fetched_in[1]) for key in self.rec.tallies)

    def on_forward(self, module: Any, args: Any) -> None:
        if self._live() and not self.rec.in_data:
            quietly(self._on_forward, module, args, sys._getframe(1))  # (the audit's own work: unseen.untraced)

    def _on_forward(self, module: Any, args: Any, caller: Any) -> None:
        grad = torch.is_grad_enabled()
        if (grad and self.iteration is not None and self.backward_in_step and not self.pending
                and self._watching_updates()):
            probes.settle_traced_steps()  # (an optimizer step in compiled code is read first: it marks the step)
            if not self.pending and self._watching_updates() and self._updated(module):
                self.mode = "update"
                self.pending = True  # (on_pass closes the step here and begins the next)
        if not grad and self.pending and _nested_call(caller):
            return  # (a tail's module calls inside its outermost one: that one is the pass)
        self.on_pass(tail=not grad)
        if not grad and self.pending and self._fwd_on:  # (the calls inside it: not seen, see one_call)
            # (back at its end unless the step's end took it off meanwhile)
            self._tail_call.watch(module, None, ((nn_module._global_forward_pre_hooks, self._fwd_hook.id,
                                                      self.on_forward),), lambda: self._fwd_on)
        if (grad and self.iteration is not None and self.fingerprint is None and self._watching_updates()
                and not self._trusting_updates()):
            self.fingerprint = self._fingerprint(module)
            self._update_forward_hook()

    # -- weight updates outside torch.optim ------------------------------------------------------

    def _watching_updates(self) -> bool:
        """Whether a weight update may mark this program's steps: no optimizer has begun a step
        (an LBFGS closure's forwards run inside its first one, between its own updates), no
        training DataLoader is known, no marker is used."""
        return (self.mode in (None, "update") and not self.optimizer_begun and self.train_loader is None)

    def _optimizer_begins(self, opt: Any, args: Any, kwargs: Any) -> None:
        """torch's global optimizer step pre-hook, until the first step has begun: a program that
        steps a torch.optim optimizer marks its steps with it, not with weight updates."""
        self.optimizer_begun = True

    def _trusting_updates(self) -> bool:
        """Whether every forward after a backward pass is taken for an update's, unchecked."""
        return self.updates_seen >= UPDATES_TO_TRUST and not self.micro_seen

    def _updated(self, module: Any) -> bool:
        """A forward with grad enabled follows the open step's backward pass: did the weights of
        the step's first forward's module change since it ran (an update), or not (a micro-batch)?"""
        if self._trusting_updates():
            return True
        before, self.fingerprint = self.fingerprint, None
        first = before[0]() if before is not None else None
        now = self._fingerprint(first) if first is not None else None
        if now is None:
            return False
        changed = before[1] != now[1]
        if not changed and before[2] is not None and now[2] is not None:
            with no_torch_function():
                changed = not torch.equal(before[2], now[2])
        if changed:
            self.updates_seen += 1
        else:
            self.micro_seen = True
            self.fingerprint = before  # (the step's micro-batches compare with its first forward)
        return changed

    def _leaves_watched(self) -> bool:
        """Whether backward passes may mark this program's steps by the leaves they reach: weight
        updates may mark them (_watching_updates) and no module forward has been read in the open
        step (a program of plain tensors, pytorch/tutorials' polynomial_autograd: `a -= lr *
        a.grad` under no_grad; a forward through a module is read at the forward instead)."""
        return self.fingerprint is None and self.leaf_checks < LEAF_CHECKS and self._watching_updates()

    def _leaves_updated(self) -> bool:
        """A backward pass follows one in the open step: did the leaves the last one reached
        change since it began (an update), or not (a micro-batch, a second loss)?"""
        if self._trusting_updates():
            return True
        before, self.leaves = self.leaves, None
        if not before:
            return False
        self.leaf_checks += 1
        alive = [(ref(), v) for ref, v in before[0]]
        if any(t is not None and t._version != v for t, v in alive):
            changed = True
        else:
            now = self._norms([t for t, _ in alive if t is not None])
            changed = before[1] is not None and now is not None and not torch.equal(before[1], now)
        if changed:
            self.updates_seen += 1
            self.leaf_checks = 0
            self.by_leaves = True
        else:
            self.micro_seen = True  # (so every later pass is compared: none is trusted to be a step's)
        return changed

    def _leaf_fingerprint(self, tensors: Any) -> tuple | None:
        """(weak references to the leaves requiring grad a backward pass from `tensors` reaches,
        with their version counters; their norms), None where there are none or the graph is
        larger than LEAF_NODES."""
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors) if isinstance(tensors, (list, tuple)) else []
        stack = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        seen: set = set()
        leaves = []
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            if len(seen) > LEAF_NODES:
                return None
            v = getattr(node, "variable", None)  # (an AccumulateGrad node: its leaf)
            if isinstance(v, torch.Tensor):
                leaves.append(v)
            else:
                stack.extend(f for f, _ in node.next_functions)
        if not leaves:
            return None
        try:
            refs = [(weakref.ref(t), t._version) for t in leaves]
        except TypeError:
            return None
        return refs, self._norms(leaves)

    @staticmethod
    def _norms(tensors: list) -> Any:
        """The norms of `tensors` (their non-empty floating-point ones, stacked), which an update
        through `.data` changes where it moves no version counter; None where one is a tensor
        subclass (a DTensor's norm is a collective) or no norm takes one (sparse, meta): the
        counters alone tell then."""
        if any(type(t.data) is not torch.Tensor for t in tensors):
            return None
        try:
            with no_torch_function(), torch.no_grad():
                ts = [t.detach() for t in tensors if t.numel() and t.dtype.is_floating_point]
                return torch.stack([n.float() for n in torch._foreach_norm(ts)]) if ts else None
        except Exception:
            return None

    @staticmethod
    def _fingerprint(module: Any) -> tuple | None:
        """(a weak reference to `module`, its trainable parameters' version counters, their norms):
        an in-place update under no_grad moves the counters, one through `.data` does not but
        changes the norms. None for a module that cannot be read so (no weak reference, no
        trainable parameters)."""
        try:
            ref = weakref.ref(module)
            params = [p for p in module.parameters() if p.requires_grad]
        except Exception:  # (not a plain Module: it marks no steps)
            return None
        if not params:
            return None
        return ref, tuple(p._version for p in params), StepFinder._norms(params)

    def on_pass(self, tail: bool = False) -> None:
        """An outermost forward or a backward pass, where no training DataLoader marks steps;
        tail: a forward run under no_grad, which an iteration runs after its optimizer step."""
        if self.mode == "marker" or self.train_loader is not None:
            return
        if self.iteration is None:
            if tail and self.in_tail_outside:
                return
            if self._setting_up():
                if not self.setup_sent:
                    self._flush_outside()  # (the setup up to here; the passes' own work is sent after)
                self.setup_passes = True
                return
            self.in_tail_outside = False
            self._flush_outside()
            self._begin()
        elif self.pending and tail and self.mode == "optimizer":
            self.tail_passes += 1
            if self.tail_limit is not None and self.tail_passes > max(self.tail_limit, 1):
                self.in_tail_outside = True
                self._end()
        elif self.pending:
            self._tail_held()
            self._end()
            self._flush_outside()
            self._begin()

    def _tail_held(self) -> None:
        """The open step closes with its tail whole: the next step's may hold as many no-grad
        forwards as this one's did, or as the most any step of the loop held (its first aside, whose
        tail is unbounded), and one in any case (on_pass). An agent that runs its policy under
        no_grad on some iterations only (an epsilon-greedy action: pytorch/tutorials' DQN) holds 0
        or 1 at random, and a step after one of 0 is no evaluation for holding 1."""
        if self.iteration != self.loop_start:
            self.tail_most = max(self.tail_most, self.tail_passes)
        self.tail_limit = max(self.tail_passes, self.tail_most)

    def _setting_up(self) -> bool:
        """Whether a pass before any step is the program's setup: it has made a DataLoader and not
        fetched from it yet (fast_neural_style's forward of its style image through VGG, a sanity
        check's forward of a dummy batch, before `for x, _ in train_loader:`). The loop begins at
        the fetch, and the passes' work is sent as setup; a program that trains without fetching
        begins its first step at its first optimizer step, with the passes before it in it."""
        return (self.begun == 0 and self.first_loader is None and bool(self.rec.dataloaders)
                and not self.no_optimizer)  # (a program that never makes one: its work is one step, as before)

    def on_optimizer_step(self, opt: Any) -> None:
        if not self._live():
            return
        self._forget_gone_loaders()
        if (self.iteration is None and self.train_loader is not None and self.last_loader is not None
                and self.last_loader != self.train_loader and self.last_loader not in self.not_training):
            # the loader fetched since the last step closed is the one the loop trains on now (a
            # stage's new DataLoader, the old one kept): its fetches begin the steps from here
            self.train_loader = self.last_loader
        if self.iteration is None and self.ran_out_at is not None and self.backward_since_update and self.setup_sent:
            # the last batch of an epoch that a wrapper fetched one ahead (timm's PrefetchLoader,
            # accelerate's loader) trained on after the loader ran out: the iteration began at that
            # fetch, and its forward and backward since are its own, not work between steps
            self._begin(*self.ran_out_at)
        elif self.iteration is None:  # (an optimizer step with no step open: it is one)
            if self.setup_passes:  # (a loop that never fetches: the passes taken for setup were its first iteration's)
                self.setup_passes = False
            else:
                self._flush_outside()
            self._begin()
        if self.mode in (None, "dataloader", "update"):
            self.mode = "optimizer"
        if id(opt) in self.opts_in_step and self.backward_since_update:
            self._skipped_by(opt)
            self._repeated()
        self.backward_since_update = False
        if id(opt) not in self.opts_in_step and self.iteration is not None and self.iteration >= self.skip:
            self.opt_calls += 1  # (optimizers stepped per iteration: GradScaler's skipped steps count)
            name = type(opt).__name__
            self.opt_names[name] = self.opt_names.get(name, 0) + 1
        self.opts_in_step.add(id(opt))
        if id(opt) not in self.known_opts and id(opt) not in self.occasional:
            self.known_opts.add(id(opt))
            self.step_lines[id(opt)] = user_frame(sys._getframe(1))
            self._forget_when_gone(opt)
            if self.begun > 1:  # (an optimizer new after the first step: a new loop, whose tail is its own)
                self.tail_limit, self.tail_most = None, 0
                self.loop_start = self.iteration if self.iteration is not None else self.begun
        self.optimizer_begun = True  # (a compiled step runs no pre-hook)
        self._drop_begins_hook()  # (here, not in the hook: torch is iterating over its pre-hooks there)
        if self.train_loader is None and self.last_loader is not None and self.last_loader not in self.not_training:
            self.train_loader = self.last_loader
        if self.mode == "optimizer" and self.opts_in_step >= self.known_opts:
            self.pending = True
        self._update_forward_hook()

    def _forget_when_gone(self, opt: Any) -> None:
        """An optimizer the program has let go of (`del optimizer`, a stage's optimizer replaced by
        the next's) steps no more: it leaves the optimizers a step waits for, and its id, which a
        new object may take, with it."""
        try:
            weakref.finalize(opt, self._forget_opt, id(opt)).atexit = False
        except TypeError:  # (an object without weak references: kept, as before)
            pass

    def _forget_opt(self, ident: int) -> None:
        self.known_opts.discard(ident)
        self.occasional.discard(ident)
        self.step_lines.pop(ident, None)

    def _skipped_by(self, opt: Any) -> None:
        """`opt` steps again in the open step, on a new backward pass, before the known optimizers
        that have not stepped in it: those whose step is in the innermost loop that holds `opt`'s
        step are stepped in some iterations of it only (TD3's delayed actor), and no longer waited
        for (see the module's docstring)."""
        for other in self.known_opts - self.opts_in_step:
            if step_loops.in_same_loop(self.step_lines.get(id(opt)), self.step_lines.get(other)):
                self.known_opts.discard(other)
                self.occasional.add(other)

    def _repeated(self) -> None:
        """An optimizer that already stepped in the open step steps again, on a new backward pass
        (see the module's docstring): at REPEATS_TO_SPLIT such updates the training DataLoader, if
        any, is given up and the optimizers known are this step's."""
        self.repeats += 1
        if self.repeats < REPEATS_TO_SPLIT:
            return
        if self.train_loader is not None:
            self.not_training.add(self.train_loader)
            self.train_loader = None
        self.known_opts = set(self.opts_in_step)

    def on_marker(self) -> None:
        """auditor.step(): the end of one iteration."""
        if not self._live():
            return
        self.mode = "marker"
        if self.iteration is not None:
            self._end()
        self._flush_outside()
        self._begin()

    # -- boundaries ----------------------------------------------------------------------------

    def _begin(self, t0: float | None = None, c0: float | None = None) -> None:
        self.busy = True
        try:
            it = self.iteration = self.begun
            self.begun += 1
            self.ran_out_at = None
            self.fetched_in = None
            self.pending = False
            self.opts_in_step = set()
            self.backward_in_step = False
            self.repeats = 0
            self.fingerprint = None
            self.tail_passes = 0
            if it >= self.skip:
                self.session.begin(it - self.skip, t0, c0)
            self._update_forward_hook()
        finally:
            self.busy = False

    def _end(self) -> None:
        """The open step ends; after the audit's last step, the program is ended (StepsDone)."""
        self.busy = True
        try:
            it, self.iteration = self.iteration, None
            self.pending = False
            if it is not None and it >= self.skip:
                self.session.end(it - self.skip)
                self.recorded += 1
                n = len(self.opts_in_step)
                self.opts_per_step[n] = self.opts_per_step.get(n, 0) + 1
                self.last_audited = it - self.skip
            else:
                self.rec.drain(graphs=False)  # a skipped step: not recorded
            self.outside_t0 = time.perf_counter()
            self._update_forward_hook()
        finally:
            self.busy = False
        if not self.to_end and self.recorded >= self.steps:
            self.done = self.stopped = True
            self._set_forward_hook(False)
            raise StepsDone(f"the audit's {self.steps} step(s) are done")

    def _flush_outside(self) -> None:
        """What ran since the last step (or, before the first, the setup) is sent, before a step begins."""
        if not self.setup_sent:
            self.setup_sent = True
            self.send_setup()
        elif self.setup_passes:  # (the passes before the loop's first fetch: setup too, sent as more of it)
            self.setup_passes = False
            self.send_setup()
        elif self.last_audited is None:
            self.rec.drain(graphs=False)  # between skipped steps: not recorded
        else:
            self._send_outside("between")
        self.outside_t0 = time.perf_counter()

    def _send_outside(self, phase: str) -> None:
        # (graphs freed between two steps are told with the next step's record: alone, they would
        # make a stretch between steps of a program that does nothing there)
        ms = (time.perf_counter() - self.outside_t0) * 1e3
        tallies = self.rec.drain(graphs=phase == "after")
        if tallies or phase == "after" or ms >= UNPROBED_STRETCH_MS:
            self.send(wire.Outside(phase=phase, after_step=self.last_audited, ms=ms, tallies=tallies))

    def finish(self, failed: bool = False) -> None:
        """The program has ended (returned, exited or raised, `failed`: in the open step)."""
        was_done = self.done
        self.done = True
        self.uninstall()
        if self.iteration is not None and not was_done:
            it, self.iteration = self.iteration, None
            audited = it >= self.skip
            ended = (failed or self.pending or self.mode in (None, "dataloader") or bool(self.opts_in_step)
                     or (self.mode == "update" and self.backward_in_step))
            if self.mode == "marker" and not failed:
                ended = False
            if audited and ended:
                self.session.end(it - self.skip, failed=failed)
                self.recorded += 1
                self.last_audited = it - self.skip
                self.outside_t0 = time.perf_counter()
            elif audited:
                self.session.drop(it - self.skip)
        if not self.setup_sent or self.setup_passes:  # (passes taken for setup, and no loop after them)
            self.setup_sent, self.setup_passes = True, False
            self.send_setup()
        elif self.last_audited is not None:
            self._send_outside("after")

    def found(self) -> tuple[str, str]:
        """(steps_by, the report's phrase) for how the steps were found."""
        if self.mode == "optimizer" or (self.mode is None and self.known_opts):
            names = ", ".join(sorted(self.opt_names, key=lambda n: -self.opt_names[n])) or "torch.optim"
            stepped = sorted(n for n in self.opts_per_step if n)
            per = self.opt_calls / self.recorded if self.recorded else 0
            per_text = f"{per:.0f}" if abs(per - round(per)) < 0.05 else f"{per:.1f}"
            if stepped and (stepped[0] != stepped[-1] or self.opts_per_step.get(0)):
                # (a program that changes how it updates: one optimizer, then one per parameter; by
                # hand first, then with torch.optim)
                per_text = f"{stepped[0]}" if stepped[0] == stepped[-1] else f"{stepped[0]}-{stepped[-1]}"
            none = self.opts_per_step.get(0) if stepped else None
            without = (f" (none in {none} of the {self.recorded} steps"
                       + (", marked by weight updates outside torch.optim" if self.updates_seen else "") + ")"
                       if none else "")
            loader = "; each begins at a fetch of the training DataLoader" if self.train_loader is not None else ""
            return "optimizer", f"optimizer steps ({names}), {per_text} per iteration{without}{loader}"
        if self.mode == "dataloader":
            return "dataloader", "DataLoader iterations (no optimizer stepped)"
        if self.mode == "marker":
            return "marker", "auditor.step() markers"
        if self.mode == "update" and self.by_leaves:
            return "update", ("weight updates outside torch.optim (the tensors a backward pass reached changed "
                              "before the next backward pass), 1 per iteration")
        if self.mode == "update":
            return "update", ("weight updates outside torch.optim (the weights changed between a backward pass "
                              "and the next forward), 1 per iteration")
        if self.begun:
            return "none", ("no optimizer step, repeated DataLoader iteration or auditor.step() marker: "
                            "the program's work from its first forward pass or fetch is one step")
        return "none", "no step found (no optimizer step, DataLoader iteration or auditor.step() marker ran)"

    # -- the forward hook, installed only while a forward would cross a boundary ----------------

    def _update_forward_hook(self) -> None:
        want = (not self.done and self.mode != "marker" and self.train_loader is None
                and (self.iteration is None or self.pending
                     or (self._watching_updates() and (self.backward_in_step or (
                         self.fingerprint is None and not self._trusting_updates())))))
        self._set_forward_hook(want)

    def _set_forward_hook(self, want: bool) -> None:
        """The global forward pre-hook on or off. Registered once; after that it is put into (first
        of the global pre-hooks: the boundary is crossed before the probes time the forward) and
        taken out of torch's dict by its key, twice a step, without a new handle each time."""
        hooks = nn_module._global_forward_pre_hooks
        if self._fwd_hook is None:
            if not want:
                return
            self._fwd_hook = nn_module.register_module_forward_pre_hook(self.on_forward)
            self._undo.append(self._fwd_hook.remove)
        key = self._fwd_hook.id
        if want and not self._fwd_on:
            hooks[key] = self.on_forward
            hooks.move_to_end(key, last=False)
        elif not want and self._fwd_on:
            hooks.pop(key, None)
        self._fwd_on = want
