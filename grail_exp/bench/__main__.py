"""`python -m grail_exp.bench`."""

from grail_exp.bench.synthetic import main

if __name__ == "__main__":
    main()
