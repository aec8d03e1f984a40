"""The numerics collector: where values stop being finite, gradient norms, learning rates, AMP.

Why it exists: a NaN is found long after it was made. Re-running a step to look for it is not an
option (steps have side effects, and after the first NaN the weights are poisoned), so everything
the rules need is recorded while the steps run, cheaply enough to stay on for the whole audit:

* mode.py: a TorchFunctionMode, pushed only while the user's step runs, sees every torch call
  made from Python; ops.py says what kind of call each is, values.py reads the ranges recorded
  back once at the step's end.
* collector.py: the collector (`Numerics`), its per-op checks and the module hooks that check a
  library leaf module (nn.Linear) as one op; sites.py its tables of sites and modules;
  deferral.py the CPU checks a finite loss makes unnecessary.
* optimizer.py: gradient norms, learning rates and the weights after each optimizer step.
* record.py and origin.py: the step's record and where its non-finite values started.
* backward_probe.py: the ops of a user's hand-written backward, checked as the step's own.
* config_probes.py and amp_probes.py: what the configuration says (optimizers, schedulers,
  state loads, autocast, GradScaler, clipping), for the rules to compare with what ran.

The records the collector sends are typed in auditor.evidence.numerics (NumericsStep per step,
NumericsFinal at the end).

Cost (bench/bench_numerics.py, bench/bench_leaves.py): per checked call one `aminmax` of its result
(none for relu, sigmoid and tanh, whose range follows from their input's) plus ~10-20 us of Python
and the mode's own dispatch, ~20 us per deferred CPU leaf call; per optimizer step one
`_foreach_norm` of the gradients and one range per parameter after the update. On the CPU, where
reading a value costs no device sync, values are read as they are made (one `item` each) instead
of batched, and the weights are not re-measured after an update that cannot have made them
non-finite (built-in optimizer, finite lr, eps > 0, finite moderate gradients); they are
re-measured at least every PARAM_REFRESH steps. Calls inside a library module (Linear inside
Sequential) take the user's line found once by the module pre-hook instead of walking the stack
per call. Calls inside code torch.compile compiled, batch loading, `zero_grad` and the
optimizer's own update are not checked one by one.
"""
