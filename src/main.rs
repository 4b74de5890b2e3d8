use std::process::ExitCode;

fn main() -> ExitCode {
    keywatch::command::main()
}
