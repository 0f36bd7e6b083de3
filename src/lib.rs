pub use ucxkit_transport as transport;
