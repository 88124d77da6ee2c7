//! A task that ends when its owner lets go of it.

/// Ends a task when dropped.
pub struct AbortOnDrop<T = ()>(pub tokio::task::JoinHandle<T>);

impl<T> AbortOnDrop<T> {
    /// Its outcome (`None`: it failed).
    pub async fn join(mut self) -> Option<T> {
        (&mut self.0).await.ok()
    }
}

impl<T> Drop for AbortOnDrop<T> {
    fn drop(&mut self) {
        self.0.abort();
    }
}
