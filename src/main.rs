use std::process::ExitCode;

fn main() -> ExitCode {
    keywatch::cli::main()
}
