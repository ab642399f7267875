"""Pipeline parallelism. `schedules` holds the per-rank orders of forwards, backwards and
point-to-point messages as plain lists, with a checker and a timing simulator; no torch, no Ray."""
