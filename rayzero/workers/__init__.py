"""What runs inside each rank's process. `Rank` needs no Ray; `RankActor` wraps it."""
