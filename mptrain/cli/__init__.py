"""The command line: how ``mptrain ...`` becomes checked, typed runs.

- :mod:`.app`: the console script (``mptrain``, ``python -m mptrain``): ``--help``, the
  subcommands, the exit codes; the one module of the package above the commands.
- :mod:`.arguments`: the command line's arguments, nothing dropped.
- :mod:`.preflight`: every job composed and checked the way Hydra will run it, before any trains;
  the sweep-directory lock; one job composed for a subcommand.
- :mod:`.launch`: the checked jobs on Hydra, and each job's task (:func:`.launch.run_job`).
- :mod:`.registry`: ConfigStore registration and :func:`.registry.to_run_config`, the edge past
  which nothing sees OmegaConf.
- :mod:`.resume`: which run ``resume=auto`` continues when the command names none.
- :mod:`.record`: Hydra's ``.hydra/`` record, staged until the run owns its directory.
- :mod:`.usage`: ``--help`` texts; :mod:`.plugins`: the package of a missing Hydra plugin.
"""
