"""The job: every rank's start-up and lifetime (spmd rank 0 / workers, ``--multithread``
threads mode, the supervisor, the spawn / SSH launcher, signals). Sits above ``engine/``
and below ``cli.py``; ``job.run_job`` is the entry, called by the composition root."""
