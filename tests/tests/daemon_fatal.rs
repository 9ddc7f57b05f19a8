//! The daemon's supervision of its threads and tasks (no root): a panic anywhere is recorded
//! with the thread it happened on, and only the first one, which is what takes `/ready` down and
//! makes the daemon exit non-zero instead of running on with a part of it dead.

use proxy::daemon::Fatal;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_first_panic_on_any_thread_or_task_is_the_recorded_cause() {
    let fatal = Fatal::install();
    assert_eq!(fatal.cause(), None, "nothing panicked yet");
    // A task's panic, which tokio would otherwise only hand to a JoinHandle nobody awaits.
    let task = tokio::spawn(async { panic!("a cluster loop failed") });
    assert!(task.await.is_err());
    let cause = fatal.cause().expect("the task's panic was recorded");
    assert!(cause.contains("a cluster loop failed"), "{cause}");
    assert!(cause.starts_with("thread tokio-"), "{cause}");
    // A thread of its own (as the engine's), later: the first panic stays the cause.
    let thread = std::thread::Builder::new()
        .name("proxy-engine-7".to_owned())
        .spawn(|| panic!("engine step failed"))
        .unwrap();
    assert!(thread.join().is_err());
    assert_eq!(
        fatal.cause(),
        Some(cause),
        "the first panic stays the cause"
    );
}
