"""Small-scale reproductions of the seed papers' claims (`fastrpe reproduce NAME`).

Each experiment module exposes `add_arguments(parser)` and `run(args, out_dir) -> dict`
(the JSON it wrote); `EXPERIMENTS` maps names to modules. `lm` holds the small causal-LM
training and evaluation that several of them share."""
EXPERIMENTS = {
    "approx": "fastrpe.reproduce.approx",
    "stability": "fastrpe.reproduce.stability",
    "conversion": "fastrpe.reproduce.conversion",
    "speed": "fastrpe.reproduce.speed",
    "fastrpb": "fastrpe.reproduce.fastrpb",
    "extrapolation": "fastrpe.reproduce.extrapolation",
}
