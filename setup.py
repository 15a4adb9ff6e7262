"""Package discovery for setuptools (everything else is in pyproject.toml).

The design fixes ``cli/`` and ``metal/`` at the repository root; they install as
``dflash2_mlx.cli`` and ``dflash2_mlx.metal``.  Every package under them and under
``dflash2_mlx/`` is found, so a new subpackage can't be left out of the wheel;
``scripts/`` and ``tests/`` are not part of the package.
"""

from setuptools import find_packages, setup

MAPPED = {"cli": "dflash2_mlx.cli", "metal": "dflash2_mlx.metal"}

packages = find_packages(include=["dflash2_mlx", "dflash2_mlx.*"])
package_dir = {"dflash2_mlx": "dflash2_mlx"}
for folder, name in MAPPED.items():
    package_dir[name] = folder
    packages += [name] + [f"{name}.{sub}" for sub in find_packages(folder)]

setup(packages=packages, package_dir=package_dir)
