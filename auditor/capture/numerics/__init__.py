"""The numerics collector: where values stop being finite, gradient norms, learning rates, AMP.

A NaN is found long after it was made, and a step cannot be re-run to look for it (side effects,
poisoned weights), so what the rules need is recorded while the steps run, cheaply enough to stay
on for the whole audit:
* mode.py: a TorchFunctionMode, pushed only while the user's step runs; ops.py classifies each
  call, values.py reads the recorded ranges back once at the step's end.
* collector.py: the collector (`Numerics`), its per-op checks and the hooks that check a library
  leaf module as one op; sites.py its tables; deferral.py the CPU checks a finite loss makes moot.
* optimizer.py: gradient norms, learning rates and the weights after each optimizer step.
* record.py and origin.py: the step's record and where its non-finite values started.
* backward_probe.py: the ops of a user's hand-written backward.
* config_probes.py and amp_probes.py: what the configuration says, to compare with what ran.
Records are typed in auditor.evidence.numerics (NumericsStep, NumericsFinal). Compiled code, batch
loading, `zero_grad` and the optimizer's own update are not checked call by call.
The cost of each check and the measurements: bench/HISTORY.md, "auditor/capture/numerics/__init__.py".
"""
