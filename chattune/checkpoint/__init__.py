"""The run's state on disk: what a checkpoint holds (`run_state`), its directory's files and commit (`layout`), the
collective saves and loads (`checkpoint`), the snapshots a stop writes (`snapshot`, staged through `staging`), what a
relaunch resumes (`resume`) and the run's output directory (`output_dir`)."""
