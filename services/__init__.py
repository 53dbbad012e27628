"""The five gpusched services. Each is a package with a pure ``domain`` core and a thin adapter
(``__main__``). They share :mod:`schemas` and :mod:`gpusched`, and never import each other."""
