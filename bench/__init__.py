"""Benchmarks and measurements, kept beside the modules they measure so that those read as the concept alone.
Each runs through its module's command line: python sampler.py --bench, python grpo.py --bench,
python verifier.py --measure, python sandbox.py --bench, python answers.py --bench-equiv."""
