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
    "luo-fig1a": "fastrpe.reproduce.luo_fig1a",
    "scaleformer-fig4": "fastrpe.reproduce.scaleformer_fig4",
    "scaleformer-fig6": "fastrpe.reproduce.scaleformer_fig6",
    "luo-fig3a": "fastrpe.reproduce.luo_fig3a",
    "kerple-table4": "fastrpe.reproduce.kerple_table4",
    "kerple-table5": "fastrpe.reproduce.kerple_table5",
    "fastrpb-table3": "fastrpe.reproduce.fastrpb_table3",
}
