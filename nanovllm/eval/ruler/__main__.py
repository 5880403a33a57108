"""python -m nanovllm.eval.ruler --lengths 4096 --tasks all --samples 5 ..."""
from nanovllm.eval.ruler.run import main

main()
