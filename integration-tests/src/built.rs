//! Binaries the tests run as a user would: the command-line tool, an
//! example.

use std::path::PathBuf;
use std::process::Command;

/// The binary `env_var` names, when set (`scripts/test` passes ones its own
/// builds made, which saves a build with another feature set: 75 s on a
/// fresh 2-core machine). Otherwise built with `cargo build CARGO_ARGS`, as
/// trybuild builds its cases: with the cargo that runs this test (`CARGO`)
/// and its target directory, so a second run rebuilds nothing; `artifact`
/// is the binary's path under the dev profile's directory (`cache-sync`,
/// `examples/clusters`). Call it once per test process.
pub fn binary(env_var: &str, cargo_args: &[&str], artifact: &str) -> PathBuf {
    if let Some(bin) = std::env::var_os(env_var) {
        let bin = PathBuf::from(bin);
        assert!(bin.is_file(), "{env_var} names no file: {bin:?}");
        return bin;
    }
    // A test runs as <target>/<profile>/deps/<name>-<hash>.
    let exe = std::env::current_exe().expect("the test's own path");
    let profile_dir = exe
        .parent()
        .and_then(|deps| deps.parent())
        .expect("the test binary sits in <target>/<profile>/deps");
    let target = profile_dir.parent().expect("<target>/<profile>");
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let status = Command::new(cargo)
        .arg("build")
        .args(cargo_args)
        .env("CARGO_TARGET_DIR", target)
        .status()
        .expect("run cargo build");
    assert!(status.success(), "cargo build {cargo_args:?} failed");
    // Tests run in the dev profile's directory (`debug`) unless cargo was
    // told otherwise; the build above used the dev profile too.
    let bin = target.join("debug").join(artifact);
    assert!(bin.is_file(), "cargo build {cargo_args:?} made no {bin:?}");
    bin
}
