"""Child process of test_s3: saves steps 1 and 2 to an S3 URL; the parent kills it mid-upload.

argv: endpoint url staging_dir upload_mode
"""

from __future__ import annotations

import sys

from test_s3 import make_run, s3_config

from checkpoint_manager import DefaultCheckpointManager, SaveContext


def main() -> None:
    endpoint, url, staging, mode = sys.argv[1:5]
    run = make_run()
    config = s3_config(url, endpoint, staging, upload_mode=mode, save_every_n_steps=1)
    manager = DefaultCheckpointManager(config)
    for step in (1, 2):
        run.train_step()
        manager.save(SaveContext(**run.save_kwargs()))
        print(f"committed {step}", flush=True)


if __name__ == "__main__":
    main()
