"""python -m fbos_jax.datasets.arith_word [--out_dir=DIR] [--seed=0] [--num_train=400] [--num_test=100]"""
import argparse

from fbos_jax.datasets import arith_word


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__)
  ap.add_argument("--out_dir", default=arith_word.DATA_DIR,
                  help="where train.jsonl / test.jsonl go (default: next to the generator)")
  ap.add_argument("--seed", type=int, default=arith_word.DEFAULT_SEED)
  ap.add_argument("--num_train", type=int, default=arith_word.DEFAULT_NUM_TRAIN)
  ap.add_argument("--num_test", type=int, default=arith_word.DEFAULT_NUM_TEST)
  args = ap.parse_args(argv)
  paths = arith_word.write(args.out_dir, seed=args.seed, num_train=args.num_train,
                           num_test=args.num_test)
  for split, path in paths.items():
    print(f"{split}: {path}")


if __name__ == "__main__":
  main()
