"""Training a policy on a round's file: TRL's SFT / DPO trainers in process, or the user's own
command; a finished model is published whole, with a stamp naming what made it. Ray-free: the
distributed layer runs it as a Ray task."""

from specrej_ray.train.job import TRAIN_STAMP, TrainJob, read_stamp, remove_leftovers, train

__all__ = ["TRAIN_STAMP", "TrainJob", "read_stamp", "remove_leftovers", "train"]
