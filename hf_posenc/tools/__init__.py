"""The tools built on the library: the ``hf-posenc`` command and what its subcommands share. Nothing in the library
imports from here.

- ``cli``: the command; one module per subcommand, named as it: ``finetune`` (a package, one module per part),
  ``eval_ppl``, ``passkey``, ``niah``, ``lm_eval_run`` (``lm-eval``), ``report``, ``main_job``, ``demo``,
  ``export``, ``publish``. Each has ``build_parser()`` and ``run(args)``, and its work as a function
  (``run_finetune``, ``run_eval``, ``run_passkey``, ``run_niah``, ``run_lm_eval``, ``run_main_job``) that takes the
  command's settings.
- Shared: ``runtime`` (refusals, option checks, the method asked for, several processes), ``outputs`` (output
  folders), ``models`` (the model loader), ``text`` (text files, documents, blocks), ``perplexity`` (the
  measurement), ``tables`` (tables and plots), ``estimates`` (memory and run time). What a tool
  needs to know about a model's family (LoRA targets, shape, trained window) it asks the family
  (``hf_posenc.registry.get_family(config)``).
"""
