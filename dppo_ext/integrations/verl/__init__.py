"""dppo_ext's DPPO loss modes inside verl (``pip install 'dppo_ext[verl]'``, docs/verl.md).

verl loads :mod:`dppo_ext.integrations.verl.plugin` through its ``verl.plugins`` entry point on ``import verl``;
a run then picks a mode with ``actor_rollout_ref.actor.policy_loss.loss_mode=``:

* ``dppo_topk_tv`` / ``dppo_topk_kl``: top-K DPPO (the paper's TV / KL over the rollout's top-K plus the rest),
  computed from the logits inside verl's FSDP engine against the rollout's log-probs and top-K, which verl's vLLM
  rollout returns with ``actor_rollout_ref.rollout.custom.dppo_topk=K``;
* ``dppo_tv`` / ``dppo_kl``: verl's binary DPPO losses with verl's semantics, computed the same way.

The modules: :mod:`~dppo_ext.integrations.verl.loss` (the engine-side loss), :mod:`~dppo_ext.integrations.verl.rollout`
(the vLLM server's top-K), :mod:`~dppo_ext.integrations.verl.plugin` (what is changed in verl, and when),
:mod:`~dppo_ext.integrations.verl.import_hooks` (a function run on a module once it is imported: how the plugin, and
examples/verl_cpu_platform.py, change verl). Importing this package changes nothing; only the plugin module does, by
design.
"""
